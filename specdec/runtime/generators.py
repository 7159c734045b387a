"""torch generators for the per-call seeds of specdec.rng.RequestRng (never the global RNG)."""

from __future__ import annotations

import torch


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on `device`, seeded deterministically."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed) & ((1 << 64) - 1))
    return generator
