"""Per-request random generators (never the global RNG).

The coordinator owns one `RequestRng` per request, seeded from the request's
seed (or a fresh random one). Each round it takes `round_seeds()`: one seed for
the draft, one for the target and one for a draft call made ahead during the
round (--draft-ahead), each service building a torch.Generator from its seed
(specdec.runtime.generators.make_generator; this module imports no torch, so the
coordinator, which runs no model, does not load it). No two seeds of a request
are equal, so no two calls draw the same stream, nor is any round's a repeat of
another's; a seeded request is reproducible end to end, and a resent round
reuses its seeds.

Why the call made ahead has a seed of its own: its first draw is a guess of the
next round's bonus token, and the next round calls the draft anew exactly when
that guess was wrong. Drawn with the next round's draft seed, that call would
replay the draws that produced the wrong guess: conditioned on the guess being
wrong, its first token would no longer follow the q reported with it, and
rejection sampling would no longer give the target's distribution. A seed is
therefore never handed to two calls whose outputs are both used, or whose use
depends on the other's draws.
"""

from __future__ import annotations

import random
import secrets
from typing import NamedTuple

SEED_BITS = 63


class RoundSeeds(NamedTuple):
    """The seeds of one round, all distinct and new to the request."""

    draft: int   # the round's Propose (or the prompt sent to the draft alongside)
    target: int  # the round's Verify
    ahead: int   # the draft call made ahead during the round for the next one (--draft-ahead)


class RequestRng:
    """Seed source for the calls of one request."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(SEED_BITS) if seed is None else int(seed)
        self._random = random.Random(self.seed)
        self._issued: set[int] = set()

    def next_seed(self) -> int:
        """The next raw draw of the request's seed stream (may repeat, in principle)."""
        return self._random.getrandbits(SEED_BITS)

    def _fresh_seed(self) -> int:
        """A seed never handed out before by this request."""
        seed = self.next_seed()
        while seed in self._issued:
            seed = self.next_seed()
        self._issued.add(seed)
        return seed

    def round_seeds(self) -> RoundSeeds:
        """The next round's seeds: distinct from each other and from every seed of the
        request's earlier rounds."""
        return RoundSeeds(self._fresh_seed(), self._fresh_seed(), self._fresh_seed())
