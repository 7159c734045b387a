"""Per-request random generators (never the global RNG).

The coordinator owns one `RequestRng` per request, seeded from the request's
seed (or a fresh random one). Each round it takes `round_seeds()`: one seed for
the draft and one for the target, which build a torch.Generator from it
(specdec.runtime.generators.make_generator; this module imports no torch, so the
coordinator, which runs no model, does not load it). No two seeds of a request
are equal, so the draft's and the target's draws are never the same stream, nor
is any round's a repeat of another's; a seeded request is reproducible end to
end, and a resent round reuses its seeds.
"""

from __future__ import annotations

import random
import secrets

SEED_BITS = 63


class RequestRng:
    """Seed source for the calls of one request."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(SEED_BITS) if seed is None else int(seed)
        self._random = random.Random(self.seed)
        self._issued: set[int] = set()
        self._next: tuple[int, int] | None = None  # the next round's seeds, drawn early by peek

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

    def round_seeds(self) -> tuple[int, int]:
        """(draft_seed, target_seed) of the next round: distinct from each other and from
        every seed of the request's earlier rounds."""
        seeds, self._next = self.peek_round_seeds(), None
        return seeds

    def peek_round_seeds(self) -> tuple[int, int]:
        """The seeds the next `round_seeds()` will return (a draft call made ahead of its round
        draws with that round's seed), drawn now."""
        if self._next is None:
            draft_seed = self._fresh_seed()
            self._next = (draft_seed, self._fresh_seed())
        return self._next
