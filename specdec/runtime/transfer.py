"""Host data to the device, for every engine that runs torch on one.

Host data (token ids, positions, lengths, a tree's shape) reaches the device through `upload`,
which on a GPU copies from pinned memory without blocking: a copy from pageable memory would
stall the host until the stream has run up to it, a host synchronisation per tensor.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def upload(data: Sequence[Any], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host data (nested lists of numbers) on `device` without a host
    synchronisation: on a CUDA device built in pinned memory and copied asynchronously (the
    caching host allocator keeps the pinned block until the copy has run), elsewhere made there."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)  # made where it is used: no copy
    return torch.tensor(data, dtype=dtype, device=device)  # another accelerator: a plain copy
