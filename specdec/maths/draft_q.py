"""The draft's proposal distributions q as the target uses them: sparse, validated.

The target trusts nothing that comes over the network: a NaN probability would make
min(1, p/q) equal 1 and accept any token, and a row longer than the vocabulary would
allocate without bound. `DraftQ.from_sparse` checks every row and keeps it sparse; the
acceptance step only needs q(dᵢ) per position and, at the first rejection, one residual row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.errors import InvalidArgument
from specdec.types import SparseDist

SUM_TOLERANCE = 1e-3  # a row's probabilities must sum to 1 within this


@dataclass(frozen=True)
class DraftQ:
    """Per draft position i: the ids and probabilities of qᵢ, and qᵢ(dᵢ)."""

    ids: tuple[torch.Tensor, ...]  # γ × [kᵢ] int64
    probs: tuple[torch.Tensor, ...]  # γ × [kᵢ] float32
    of_drafts: torch.Tensor  # [γ] float32, qᵢ(dᵢ) > 0

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_sparse(cls, dists: Sequence[SparseDist], drafts: Sequence[int], vocab: int,
                    device: torch.device | str = "cpu") -> "DraftQ":
        """Validate the rows a draft sent; InvalidArgument naming the first bad row."""
        if len(dists) != len(drafts):
            raise InvalidArgument(f"{len(drafts)} draft tokens need {len(drafts)} draft_probs, got {len(dists)}")
        ids_out, probs_out, of_drafts = [], [], []
        for row, (dist, token) in enumerate(zip(dists, drafts)):
            ids, probs, q = _check_row(row, dist, token, vocab)
            ids_out.append(torch.tensor(ids, dtype=torch.long, device=device))
            probs_out.append(torch.tensor(probs, dtype=torch.float32, device=device))
            of_drafts.append(q)
        return cls(tuple(ids_out), tuple(probs_out),
                   torch.tensor(of_drafts, dtype=torch.float32, device=device))

    def to(self, device: torch.device | str) -> "DraftQ":
        """The same rows on `device`; on a GPU copied from pinned memory without blocking the host
        (the target validates q on its event loop, on the host, and moves it on the model thread)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self

        def move(tensor: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda":
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor.to(device)
        return DraftQ(tuple(move(t) for t in self.ids), tuple(move(t) for t in self.probs), move(self.of_drafts))

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "DraftQ":
        """No drafts (a target-only round): nothing to check, no host synchronisation."""
        return cls((), (), torch.zeros(0, dtype=torch.float32, device=device))

    @classmethod
    def from_dense(cls, q: torch.Tensor, drafts: Sequence[int]) -> "DraftQ":
        """From dense rows q [γ, vocab] (tests and hand-built examples); zeros are dropped."""
        ids = tuple(torch.nonzero(q[i] > 0).flatten() for i in range(len(drafts)))
        probs = tuple(q[i, ids[i]].float() for i in range(len(drafts)))
        index = torch.arange(len(drafts))
        of_drafts = q[index, torch.tensor(list(drafts), dtype=torch.long)].float() if drafts else q.new_zeros(0)
        if bool((of_drafts <= 0).any()):
            row = int(torch.nonzero(of_drafts <= 0)[0])
            raise InvalidArgument(_zero_message(row, drafts[row]))
        return cls(ids, probs, of_drafts)

    def residual(self, position: int, p: torch.Tensor) -> torch.Tensor:
        """max(0, p − qᵢ) for one position, not normalised. p: [vocab] -> [vocab]."""
        out = p.clone()
        ids = self.ids[position]
        out[ids] = torch.clamp(out[ids] - self.probs[position], min=0.0)
        return out


def _zero_message(row: int, token: int) -> str:
    return f"draft_probs[{row}]: draft token {token} has probability 0 in its own proposal distribution"


def _check_row(row: int, dist: SparseDist, token: int, vocab: int) -> tuple[list[int], list[float], float]:
    ids, probs = list(dist.token_ids), list(dist.probs)
    where = f"draft_probs[{row}]"
    if len(ids) != len(probs):
        raise InvalidArgument(f"{where}: {len(ids)} token_ids but {len(probs)} probs")
    if not 1 <= len(ids) <= vocab:
        raise InvalidArgument(f"{where}: holds {len(ids)} entries; it needs 1 to {vocab} (the vocabulary)")
    if min(ids) < 0 or max(ids) >= vocab:
        raise InvalidArgument(f"{where}: token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{where}: token ids must be unique")
    if not all(math.isfinite(x) and x >= 0.0 for x in probs):
        raise InvalidArgument(f"{where}: probabilities must be finite and >= 0")
    total = math.fsum(probs)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise InvalidArgument(f"{where}: probabilities sum to {total:.6g}, not 1 (±{SUM_TOLERANCE})")
    try:
        q = probs[ids.index(token)]
    except ValueError:
        q = 0.0
    if q <= 0.0:
        raise InvalidArgument(_zero_message(row, token))
    return ids, probs, q
