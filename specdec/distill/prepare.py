"""Everything training reads, made once with the target loaded and kept in the checkpoint
folder (so `--resume` runs no target again): the training windows with the target's top-k
distributions at each position, and the held-out sequences α is measured on."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.distill.data import Scored, windows
from specdec.distill.objectives import TopK, top_k_of

log = logging.getLogger(__name__)

PREPARED_FILE = "prepared.pt"
PREPARED_VERSION = 1


@dataclass
class Prepared:
    """The training windows, the target's top-k at each of their positions, the held-out part."""

    windows: list[list[int]]           # token ids, each window trained on alone
    targets: list[TopK]                # per window: the target's top-k at each position, [len, k]
    held_out: list[Scored]             # α is measured on these
    vocab: int                         # ids both models have logits for (the loss compares below it)
    alpha_before: dict = field(default_factory=dict)  # the draft's Alignment.to_json() before training
    summary: dict = field(default_factory=dict)       # where the data came from, for the report
    seconds: dict = field(default_factory=dict)       # what preparing took, per stage

    @property
    def positions(self) -> int:
        return sum(len(w) for w in self.windows)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {"version": PREPARED_VERSION, "windows": self.windows,
                 "ids": [t.ids.to(torch.int32) for t in self.targets], "probs": [t.probs for t in self.targets],
                 "held_out": [(s.tokens, s.start) for s in self.held_out], "vocab": self.vocab,
                 "alpha_before": self.alpha_before, "summary": self.summary, "seconds": self.seconds}
        save_state(folder / PREPARED_FILE, state)

    @classmethod
    def load(cls, folder: Path) -> "Prepared | None":
        """The prepared data saved in `folder` (None: none there, or of another version)."""
        state = load_state(folder / PREPARED_FILE, PREPARED_VERSION)
        if state is None:
            return None
        return cls(state["windows"], [TopK(i.long(), p) for i, p in zip(state["ids"], state["probs"])],
                   [Scored(list(t), int(s)) for t, s in state["held_out"]], int(state["vocab"]),
                   state["alpha_before"], state["summary"], state["seconds"])


def pad(batch: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], mask [B, L] bool): the windows right-padded to the longest."""
    length = max(len(w) for w in batch)
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.bool)
    for row, window in enumerate(batch):
        ids[row, :len(window)] = torch.tensor(window)
        mask[row, :len(window)] = True
    return ids, mask


@torch.no_grad()
def teacher_targets(target: Any, batches: list[list[int]], vocab: int, top_k: int, temperature: float,
                    batch_size: int, progress: Callable[[int], None] = lambda n: None) -> list[TopK]:
    """The target's top-k distribution at every position of every window (on the host)."""
    device = next(target.parameters()).device
    out: list[TopK] = []
    for begin in range(0, len(batches), batch_size):
        batch = batches[begin:begin + batch_size]
        ids, mask = pad(batch)
        logits = target(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[..., :vocab]
        top = top_k_of(logits, top_k, temperature).to("cpu")
        out.extend(top[row, :len(window)] for row, window in enumerate(batch))
        progress(len(batch))
    return out


def prepare(target: Any, sequences: list[list[int]], held_out: list[Scored], vocab: int, top_k: int,
            temperature: float, seq_len: int, batch_size: int, progress: Callable[[str, int], Any]) -> Prepared:
    """Windows of `sequences` and the target's top-k over them. progress(stage, total) gives a
    callback that advances a bar by n."""
    started = time.perf_counter()
    cut = windows(sequences, seq_len)
    if not cut:
        raise ValueError("no training text: every sequence is shorter than 2 tokens")
    targets = teacher_targets(target, cut, vocab, top_k, temperature, batch_size, progress("target top-k", len(cut)))
    return Prepared(cut, targets, held_out, vocab, seconds={"teacher": round(time.perf_counter() - started, 2)})


def save_state(path: Path, state: dict) -> None:
    """torch.save `state` to `path` through a partial file, so a run killed while writing leaves
    the previous state (or none), never half of one."""
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    partial.replace(path)


def load_state(path: Path, version: int) -> dict | None:
    """The state save_state wrote to `path` (None: none there, or of another version)."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True)
    if state.get("version") != version:
        log.warning("%s is of another version: preparing again", path)
        return None
    return state
