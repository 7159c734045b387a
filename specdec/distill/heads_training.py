"""`specdec distill --heads K`: Medusa-style heads (specdec/runtime/heads.py) trained on the
target's last hidden states — the target's pass over the data, the loss, the loop and the
accuracy measured on held-out text.

The target is frozen and runs once: a forward pre-hook on its output layer keeps what that
layer takes (the last hidden state, after the final norm) and its logits give the top-k
distributions, all kept in the checkpoint folder for --resume. Head k (1-based) at position t
proposes the token at t + k + 1, so it learns

* `kl` / `tv`: the target's own distribution at position t + k (self-distillation: what the
  target will verify the proposal against), on its top-k ids and the rest as objectives.py
  compares them;
* `ce`: the data's token at t + k + 1 (Medusa-1's cross-entropy).

A step's softmax runs through the shared output layer. On a large vocabulary (151,936 ids ×
1,536 for the default target) that product is most of a step, so with `head_vocab` set the
softmax runs over the batch's kept ids (every top-k id and data token the loss reads) plus
random other ids up to `head_vocab` in all, each of those standing for (vocab − kept) /
sampled ids in the normaliser (a sampled softmax: the kept ids' probabilities are exact up to
the estimate of the normaliser).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from specdec.distill.data import Scored, windows
from specdec.distill.objectives import EPS, Loss, TopK, outcome_loss, top_k_of, training_loss
from specdec.distill.prepare import load_state, pad, save_state
from specdec.distill.trainer import Trainer, TrainSettings
from specdec.runtime.heads import MedusaHeads, head_logits

log = logging.getLogger(__name__)

HEADS_PREPARED_FILE = "heads-prepared.pt"
HEADS_PREPARED_VERSION = 1
TOP_N = 4             # the hit rate reported beside top-1: the target's token among a head's N best
PASS_TOKENS = 1024    # tokens per forward of the target's pass (bounds its [tokens, vocab] logits)
EVAL_ROWS = 64        # positions whose head logits are computed at once (bounds [heads, rows, vocab])


@dataclass
class HeadsData:
    """Everything heads training reads, made with the target once: per position of the training
    windows (flattened) the target's hidden state and top-k, and the held-out sequences' states."""

    hidden: torch.Tensor        # [positions, hidden] float32, what the output layer took
    top: TopK                   # [positions, k] the target's top-k at each position
    tokens: torch.Tensor        # [positions] int64, the data's tokens
    window_end: torch.Tensor    # [positions] int64, one past the last position of the position's window
    held_hidden: list[torch.Tensor]  # per held-out sequence: [scored positions, hidden] float32
    held_greedy: list[torch.Tensor]  # per held-out sequence: [scored positions] the target's argmax there
    vocab: int                  # the output layer's rows
    before: dict = field(default_factory=dict)   # accuracy() of untrained heads
    summary: dict = field(default_factory=dict)  # where the data came from, for the report
    seconds: dict = field(default_factory=dict)  # what preparing took, per stage

    @property
    def positions(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def held_positions(self) -> int:
        return sum(int(g.shape[0]) for g in self.held_greedy)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {"version": HEADS_PREPARED_VERSION, "hidden": self.hidden, "top_ids": self.top.ids.to(torch.int32),
                 "top_probs": self.top.probs, "tokens": self.tokens, "window_end": self.window_end,
                 "held_hidden": self.held_hidden, "held_greedy": self.held_greedy, "vocab": self.vocab,
                 "before": self.before, "summary": self.summary, "seconds": self.seconds}
        save_state(folder / HEADS_PREPARED_FILE, state)

    @classmethod
    def load(cls, folder: Path) -> "HeadsData | None":
        """The data saved in `folder` (None: none there, or of another version)."""
        state = load_state(folder / HEADS_PREPARED_FILE, HEADS_PREPARED_VERSION)
        if state is None:
            return None
        return cls(state["hidden"], TopK(state["top_ids"].long(), state["top_probs"]), state["tokens"],
                   state["window_end"], state["held_hidden"], state["held_greedy"], int(state["vocab"]),
                   state["before"], state["summary"], state["seconds"])


# ---- the target's pass ----------------------------------------------------------------------------


@contextlib.contextmanager
def output_layer_inputs(model: Any) -> Iterator[list[torch.Tensor]]:
    """While open, every input the model's output layer takes is appended to the yielded list
    ([batch, length, hidden] each): exactly the hidden state the heads start from."""
    taken: list[torch.Tensor] = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: taken.append(args[0]))
    try:
        yield taken
    finally:
        handle.remove()


@torch.no_grad()
def window_pass(model: Any, cut: list[list[int]], top_k: int, temperature: float,
                progress: Callable[[int], None] = lambda n: None) -> tuple[torch.Tensor, TopK]:
    """The target over the windows `cut`, a few at a time: (hidden [positions, hidden] float32,
    top-k [positions, k]) for every position of every window, windows one after another."""
    device = next(model.parameters()).device
    per_pass = max(1, PASS_TOKENS // max(len(w) for w in cut))
    hidden, ids, probs = [], [], []
    for begin in range(0, len(cut), per_pass):
        batch = cut[begin:begin + per_pass]
        tokens, mask = pad(batch)
        with output_layer_inputs(model) as taken:
            logits = model(input_ids=tokens.to(device), attention_mask=mask.to(device)).logits  # [B, L, vocab]
        top = top_k_of(logits, top_k, temperature).to("cpu")
        states = taken[-1].float().cpu()  # [B, L, hidden]
        for row, window in enumerate(batch):
            hidden.append(states[row, :len(window)])
            ids.append(top.ids[row, :len(window)])
            probs.append(top.probs[row, :len(window)])
        progress(len(batch))
    return torch.cat(hidden), TopK(torch.cat(ids), torch.cat(probs))


@torch.no_grad()
def held_out_pass(model: Any, sequence: Scored, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [scored, hidden] float32, the target's argmax [scored]) at a held-out sequence's
    scored positions (from the one that predicts tokens[start] on), the cache carried across
    chunks as in evaluate.scored_logits."""
    device = next(model.parameters()).device
    tokens = torch.tensor([sequence.tokens], device=device)
    hidden, greedy, past = [], [], None
    for begin in range(0, tokens.shape[1], chunk):
        with output_layer_inputs(model) as taken:
            out = model(input_ids=tokens[:, begin:begin + chunk], cache=past, use_cache=True)
        past = out.cache
        first = max(sequence.start - 1 - begin, 0)
        hidden.append(taken[-1][0, first:].float().cpu())
        greedy.append(out.logits[0, first:].argmax(-1).cpu())
    return torch.cat(hidden), torch.cat(greedy)


def prepare_heads(model: Any, sequences: list[list[int]], held_out: list[Scored], top_k: int, temperature: float,
                  seq_len: int, progress: Callable[[str, int], Any]) -> HeadsData:
    """The target's pass over the training windows and the held-out sequences."""
    started = time.perf_counter()
    cut = windows(sequences, seq_len)
    if not cut:
        raise ValueError("no training text: every sequence is shorter than 2 tokens")
    hidden, top = window_pass(model, cut, top_k, temperature, progress("target pass", len(cut)))
    ends = torch.tensor([end for w, end in zip(cut, _cumulative(cut)) for _ in w], dtype=torch.long)
    tokens = torch.tensor([t for w in cut for t in w], dtype=torch.long)
    teacher = time.perf_counter() - started
    started = time.perf_counter()
    advance = progress("held-out pass", len(held_out))
    held_hidden, held_greedy = [], []
    for sequence in held_out:
        states, greedy = held_out_pass(model, sequence)
        held_hidden.append(states)
        held_greedy.append(greedy)
        advance(1)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return HeadsData(hidden, top, tokens, ends, held_hidden, held_greedy, vocab,
                     seconds={"teacher": round(teacher, 2), "held_out_pass": round(time.perf_counter() - started, 2)})


def _cumulative(cut: list[list[int]]) -> list[int]:
    """One past each window's last position in the flattened positions."""
    out, total = [], 0
    for window in cut:
        total += len(window)
        out.append(total)
    return out


# ---- the loss ----------------------------------------------------------------------------------


def candidates(kept: torch.Tensor, vocab: int, size: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids a step's softmax runs over and each one's log weight in the normaliser, ([C], [C]):
    every id of `kept` (weight 1), then random other ids up to `size` in all, each standing for
    (vocab − kept) / sampled ids. size 0 (or ≥ vocab): the whole vocabulary, all weight 1."""
    if size <= 0 or size >= vocab:
        ids = torch.arange(vocab, device=kept.device)
        return ids, torch.zeros(vocab, device=kept.device)
    kept = torch.unique(kept)
    sampled = size - kept.numel()
    if sampled <= 0:
        return kept, torch.zeros(kept.numel(), device=kept.device)
    others = torch.ones(vocab, dtype=torch.bool, device=kept.device)
    others[kept] = False
    rest = others.nonzero().squeeze(1)  # [vocab − kept]
    pick = rest[torch.randperm(rest.numel(), generator=generator)[:sampled].to(rest.device)]
    weight = math.log(rest.numel() / sampled)
    return torch.cat([kept, pick]), torch.cat([torch.zeros(kept.numel(), device=kept.device),
                                               torch.full((sampled,), weight, device=kept.device)])


def head_log_probs(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                   log_weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """states [heads, rows, hidden] through the output layer's rows `ids` only -> the log
    probabilities of those ids under softmax(logits / temperature), the normaliser estimated
    with `log_weight`: [heads, rows, C]."""
    logits = states @ weight[ids].T  # [heads, rows, C]
    if bias is not None:
        logits = logits + bias[ids]
    logits = logits.float() / temperature
    return logits - torch.logsumexp(logits + log_weight, dim=-1, keepdim=True)


@dataclass(frozen=True)
class Targets:
    """What head k learns at a batch's positions."""

    top: TopK            # [rows, k] the target's top-k at t + k (kl, tv)
    token: torch.Tensor  # [rows] the data's token at t + k + 1 (ce)
    valid: torch.Tensor  # [rows] bool: t + k (kl, tv) or t + k + 1 (ce) lies inside the window


def head_targets(data: HeadsData, rows: torch.Tensor, head: int, loss: Loss) -> Targets:
    """Head `head` (1-based) at the positions `rows` (flat indices)."""
    reach = head + (1 if loss == Loss.CE else 0)
    valid = rows + reach < data.window_end[rows]
    at = torch.where(valid, rows + head, rows)  # a masked row reads its own position
    token = data.tokens[torch.where(valid, rows + reach, rows)]
    return Targets(data.top[at], token, valid)


def heads_loss(log_q: torch.Tensor, where: torch.Tensor, targets: list[Targets], loss: Loss) -> torch.Tensor:
    """The mean loss of every head over its valid rows: log_q [heads, rows, C] over the candidate
    ids, `where` maps an id to its column there."""
    total = log_q.new_zeros(())
    for k, target in enumerate(targets):
        if loss == Loss.CE:
            values = -log_q[k].gather(-1, where[target.token].unsqueeze(-1)).squeeze(-1)  # [rows]
        else:
            q_top = log_q[k].gather(-1, where[target.top.ids]).exp()  # [rows, top-k]
            q = torch.cat([q_top, (1.0 - q_top.sum(-1, keepdim=True)).clamp_min(0.0)], -1)
            p = torch.cat([target.top.probs, (1.0 - target.top.probs.sum(-1, keepdim=True)).clamp_min(0.0)], -1)
            values = outcome_loss(p, q.clamp_min(EPS), loss)
        total = total + training_loss(values, target.valid)
    return total / len(targets)


# ---- the loop -----------------------------------------------------------------------------------


class HeadsTrainer(Trainer):
    """The draft's Trainer (AdamW, schedule, checkpoints, --resume) over the heads, a batch being
    `batch_size` positions of the training windows."""

    def __init__(self, heads: MedusaHeads, data: HeadsData, settings: TrainSettings, folder: Path,
                 device: torch.device, output_layer: Any, head_vocab: int):
        super().__init__(heads, data, settings, folder, device)
        self.weight = output_layer.weight.detach().to(device, torch.float32)  # [vocab, hidden]
        bias = getattr(output_layer, "bias", None)
        self.bias = bias.detach().to(device, torch.float32) if bias is not None else None
        self.head_vocab = head_vocab
        self.hidden = data.hidden.to(device)  # [positions, hidden]
        self.softmax_ids: list[int] = []  # per step of this process: the ids its softmax ran over

    def comparable(self) -> dict:
        return {**super().comparable(), "heads": self.model.num_heads, "head_vocab": self.head_vocab}

    def rows(self) -> int:
        return self.data.positions

    def train_step(self) -> float:
        rows = torch.tensor(self._indices(self.step), dtype=torch.long)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.step)
        loss_kind = self.settings.loss
        targets = [head_targets(self.data, rows, k, loss_kind) for k in range(1, self.model.num_heads + 1)]
        targets = [Targets(t.top.to(self.device), t.token.to(self.device), t.valid.to(self.device)) for t in targets]
        kept = torch.cat([t.token if loss_kind == Loss.CE else t.top.ids.flatten() for t in targets])
        generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + self.step)
        ids, log_weight = candidates(kept, self.data.vocab, self.head_vocab, generator)
        self.softmax_ids.append(int(ids.numel()))
        where = torch.zeros(self.data.vocab, dtype=torch.long, device=self.device)
        where[ids] = torch.arange(ids.numel(), device=self.device)
        states = self.model(self.hidden[rows.to(self.device)])  # [heads, rows, hidden]
        log_q = head_log_probs(states, self.weight, self.bias, ids, log_weight, self.settings.temperature)
        return self.descend(heads_loss(log_q, where, targets, loss_kind))


# ---- accuracy ------------------------------------------------------------------------------------


def proposal_vocabulary(data: HeadsData, size: int) -> torch.Tensor | None:
    """The `size` ids the heads will propose from (runtime/heads.py): those the training data
    holds most often — its tokens and the target's argmax at each position — then, among equal
    counts and unseen ids, the lowest (a BPE vocabulary lists its commonest merges first); sorted
    [size] int64. None for 0 or a size that covers the whole vocabulary."""
    if size <= 0 or size >= data.vocab:
        return None
    seen = torch.cat([data.tokens.flatten(), data.top.ids[:, 0].flatten()]).clamp(0, data.vocab - 1)
    counts = torch.bincount(seen, minlength=data.vocab)  # [vocab]
    ranked = torch.sort(-counts, stable=True).indices  # most frequent first, ties by lowest id
    return torch.sort(ranked[:size]).values


def vocab_coverage(data: HeadsData, vocab_ids: torch.Tensor | None) -> float:
    """The fraction of the held-out greedy tokens that lie in the proposal vocabulary."""
    if vocab_ids is None:
        return 1.0
    held = torch.cat(data.held_greedy) if data.held_greedy else torch.zeros(0, dtype=torch.long)
    return round(float(torch.isin(held, vocab_ids.cpu()).float().mean()) if held.numel() else 1.0, 4)


@torch.no_grad()
def accuracy(heads: MedusaHeads, output_layer: Any, data: HeadsData, vocab_ids: torch.Tensor | None = None) -> dict:
    """Per head k on the held-out positions t (t + k scored too): top-1 — head k's argmax is the
    target's greedy token at t + k + 1 (its argmax at t + k) — and top-N — that token is among
    the head's N most likely. Through runtime/heads.head_logits, as the target service runs them;
    with `vocab_ids` ranked among those ids only (a proposal vocabulary)."""
    was_training = heads.training
    heads.eval()
    device, dtype = heads.blocks[0].weight.device, output_layer.weight.dtype
    top1 = [0] * heads.num_heads
    top_n = [0] * heads.num_heads
    counted = [0] * heads.num_heads
    try:
        for hidden, greedy in zip(data.held_hidden, data.held_greedy):
            for begin in range(0, hidden.shape[0], EVAL_ROWS):
                chunk = hidden[begin:begin + EVAL_ROWS].to(device, dtype)  # [rows, hidden]
                logits = head_logits(heads, output_layer, chunk)  # [heads, rows, vocab]
                if vocab_ids is None:
                    best = logits.topk(TOP_N, dim=-1).indices.cpu()  # [heads, rows, N]
                else:
                    best = vocab_ids[logits[..., vocab_ids].topk(TOP_N, dim=-1).indices].cpu()
                for k in range(heads.num_heads):
                    rows = min(chunk.shape[0], greedy.shape[0] - (k + 1) - begin)
                    if rows <= 0:
                        continue
                    truth = greedy[begin + k + 1:begin + k + 1 + rows]  # [rows]
                    top1[k] += int((best[k, :rows, 0] == truth).sum())
                    top_n[k] += int((best[k, :rows] == truth.unsqueeze(-1)).any(-1).sum())
                    counted[k] += rows
    finally:
        heads.train(was_training)
    return {"heads": [{"head": k + 1, "top1": round(top1[k] / max(counted[k], 1), 4),
                       f"top{TOP_N}": round(top_n[k] / max(counted[k], 1), 4), "positions": counted[k]}
                      for k in range(heads.num_heads)]}
