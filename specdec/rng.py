"""Per-request random generators (never the global RNG).

The coordinator owns one `RequestRng` per request, seeded from the request's
seed (or a fresh random one). Each round it derives one seed for the draft and
one for the target, which build a torch.Generator from it: a seeded request is
reproducible end to end, and a resent round draws the same numbers.
"""

from __future__ import annotations

import random
import secrets

import torch

SEED_BITS = 63


class RequestRng:
    """Seed source for the calls of one request."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(SEED_BITS) if seed is None else int(seed)
        self._random = random.Random(self.seed)

    def next_seed(self) -> int:
        return self._random.getrandbits(SEED_BITS)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on `device`, seeded deterministically."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) & ((1 << 64) - 1))
    return generator
