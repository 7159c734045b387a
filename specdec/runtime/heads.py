"""Medusa-style heads on the target (Cai et al., "Medusa", 2024): K residual blocks over the
target's last hidden state that share its output layer, head k proposing the token k positions
past the one the target's own logits choose at that state. They propose only — a round
verifies their tokens like any draft — so they change the speed, never the output.

A heads directory (what `specdec distill --heads K` writes and `specdec serve target --heads`
loads):
- `heads.safetensors`: per head k (from 0), `blocks.k.weight` [hidden, hidden] and
  `blocks.k.bias` [hidden], float32; optionally `proposal_vocab` [n] int64, the ids the heads
  propose from (below);
- `heads.json`: the format version, `num_heads`, `hidden_size`, `target_identity` (what the
  heads were trained on, `target_identity` below) and `target_model_id`, `proposal_vocab` (its
  size, 0 for the whole vocabulary), and the training report.

The proposal vocabulary (FR-Spec, Zhao et al. 2025): the heads' logits are computed over the
ids most frequent in their training data only, not over the whole output layer (151,936 rows
for Qwen2.5): each Verify that asks for proposals reads a slice of the output layer instead of
all of it, and softmaxes and ranks that slice. The proposals are deterministic (q one-hot, see
coordinator/sources/heads_source.py), so which ids they may take changes the speed only, never the
output; a token outside the vocabulary is one the heads cannot propose.

Heads for another model are refused at load (`HeadsMismatch`): their proposals would be
nonsense, and a fast target whose heads never hit is a silent regression.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.types import SparseDist

HEADS_FORMAT = 1
WEIGHTS_FILE = "heads.safetensors"
META_FILE = "heads.json"
PROPOSAL_VOCAB_KEY = "proposal_vocab"  # in WEIGHTS_FILE: the sorted ids the heads propose from
_IDENTITY_ROWS = 4096  # rows of the output layer digested at a time (bounds the copy)


class HeadsMismatch(ValueError):
    """A heads directory that does not belong to the model it is loaded for (or is no heads
    directory at all): the message says which and what to do."""


class MedusaHeads(torch.nn.Module):
    """K residual blocks: head k maps the last hidden state h to h + SiLU(W_k h + b_k), which the
    target's own output layer turns into logits. W_k starts at zero, so an untrained head
    predicts what the target's next-token head does (Medusa-1's initialisation)."""

    def __init__(self, num_heads: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"heads need at least 1 head, got {num_heads}")
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.blocks = torch.nn.ModuleList(
            torch.nn.Linear(hidden_size, hidden_size, dtype=dtype, device=device) for _ in range(num_heads))
        for block in self.blocks:
            torch.nn.init.zeros_(block.weight)
            torch.nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> each head's state [heads, ..., hidden]."""
        return torch.stack([hidden + F.silu(block(hidden)) for block in self.blocks])


def head_logits(heads: MedusaHeads, output_layer: Callable[[torch.Tensor], torch.Tensor],
                hidden: torch.Tensor) -> torch.Tensor:
    """hidden [rows, hidden] (the target's last hidden states, as its output layer takes them)
    -> float32 logits [heads, rows, vocab]."""
    states = heads(hidden.to(heads.blocks[0].weight.dtype))  # [heads, rows, hidden]
    return output_layer(states.to(hidden.dtype)).float()


@torch.inference_mode()
def head_proposals(heads: MedusaHeads, output_layer: Callable[[torch.Tensor], torch.Tensor],
                   hidden: torch.Tensor, candidates: Sequence[int],
                   vocab_ids: torch.Tensor | None = None) -> list[tuple[SparseDist, ...]]:
    """Per row (hidden [rows, hidden]; candidates: per row how many tokens each head proposes,
    0 for none), per head its `candidates` most likely tokens and their probabilities under the
    head, most likely first. With `vocab_ids` [n] the output layer gives logits over those ids
    only (a proposal vocabulary) and the probabilities are over them. One read to the host for
    the batch."""
    most = max(candidates, default=0)
    if most <= 0 or hidden.shape[0] == 0:
        return [() for _ in candidates]
    probs = torch.softmax(head_logits(heads, output_layer, hidden), dim=-1)  # [heads, rows, vocab or n]
    top = torch.topk(probs, min(most, probs.shape[-1]), dim=-1)  # [heads, rows, most]
    chosen = top.indices if vocab_ids is None else vocab_ids[top.indices]  # [heads, rows, most] token ids
    ids, values = chosen.tolist(), top.values.tolist()
    return [tuple(SparseDist(tuple(ids[k][row][:n]), tuple(values[k][row][:n])) for k in range(heads.num_heads))
            if n > 0 else () for row, n in enumerate(candidates)]


def target_identity(model: Any) -> str:
    """What heads are bound to: a digest of the target's config (its architecture and sizes,
    not where it was loaded from or in which dtype) and of its output layer's weights rounded to
    bfloat16, so the same checkpoint loaded in any dtype matches and any other model does not."""
    config = {key: value for key, value in model.config.to_dict().items()
              if not key.startswith("_") and key not in ("transformers_version", "torch_dtype", "dtype")}
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    weight = model.get_output_embeddings().weight.detach()
    digest.update(f"{tuple(weight.shape)};".encode())
    for begin in range(0, weight.shape[0], _IDENTITY_ROWS):
        rows = weight[begin:begin + _IDENTITY_ROWS]
        rows = rows if rows.dtype == torch.bfloat16 else rows.float().to(torch.bfloat16)
        digest.update(rows.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class HeadsMeta:
    """heads.json: what the heads are and what they were trained for."""

    num_heads: int  # K, head 1 first
    hidden_size: int  # the target's hidden size
    target_identity: str  # target_identity() of the model they were trained on
    target_model_id: str  # where that model was loaded from (for messages only)
    report: dict = field(default_factory=dict)  # the training report (accuracy per head, ...)
    format: int = HEADS_FORMAT
    proposal_vocab: int = 0  # ids the heads propose from (PROPOSAL_VOCAB_KEY); 0: the whole vocabulary


def save_heads(directory: str | Path, heads: MedusaHeads, meta: HeadsMeta,
               proposal_vocab: torch.Tensor | None = None) -> Path:
    """Write heads.safetensors and heads.json into `directory` (created) and return it; with
    `proposal_vocab` (token ids) the heads propose from those ids only (meta records how many)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().float().contiguous().cpu() for name, tensor in heads.state_dict().items()}
    size = 0
    if proposal_vocab is not None:
        tensors[PROPOSAL_VOCAB_KEY] = torch.unique(proposal_vocab.detach().cpu().long())  # sorted, once each
        size = int(tensors[PROPOSAL_VOCAB_KEY].numel())
    save_file(tensors, str(directory / WEIGHTS_FILE))
    meta = replace(meta, proposal_vocab=size)
    (directory / META_FILE).write_text(json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")
    return directory


def read_meta(directory: str | Path) -> HeadsMeta:
    """heads.json of a heads directory (HeadsMismatch when it is none, or of another format)."""
    path = Path(directory) / META_FILE
    try:
        raw = json.loads(path.read_text())
        meta = HeadsMeta(**raw)
    except FileNotFoundError:
        raise HeadsMismatch(f"{directory} is not a heads directory: it has no {META_FILE} "
                            f"(write one with `specdec distill --heads K`)") from None
    except (ValueError, TypeError) as exc:
        raise HeadsMismatch(f"{path} is not a heads description this version reads: {exc}") from None
    if meta.format != HEADS_FORMAT:
        raise HeadsMismatch(f"{path} has heads format {meta.format}; this version reads format {HEADS_FORMAT}")
    return meta


def load_heads(directory: str | Path, model: Any, device: torch.device | str,
               dtype: torch.dtype) -> tuple[MedusaHeads, HeadsMeta, str, torch.Tensor | None]:
    """The heads in `directory` for `model` (a transformers model, or anything with its config
    and get_output_embeddings), on `device` in `dtype`, their meta, their identity (a digest of
    the weights file) and their proposal vocabulary (sorted ids [n] on `device`; None: the whole
    vocabulary). HeadsMismatch when they were trained for another model."""
    from safetensors.torch import load_file

    meta = read_meta(directory)
    mine = target_identity(model)
    if meta.target_identity != mine:
        raise HeadsMismatch(
            f"the heads in {directory} were trained for another model ({meta.target_model_id}, identity "
            f"{meta.target_identity[:12]}…) than this one (identity {mine[:12]}…): train heads for this "
            f"checkpoint with `specdec distill --heads K --target <this model>`")
    vocab_size, hidden_size = (int(n) for n in model.get_output_embeddings().weight.shape)
    if meta.hidden_size != hidden_size:
        raise HeadsMismatch(f"the heads in {directory} take hidden states of {meta.hidden_size}, "
                            f"this model's are {hidden_size}")
    weights_path = Path(directory) / WEIGHTS_FILE
    heads = MedusaHeads(meta.num_heads, meta.hidden_size)
    try:
        tensors = load_file(str(weights_path))
        vocab = tensors.pop(PROPOSAL_VOCAB_KEY, None)
        heads.load_state_dict(tensors)
    except (OSError, RuntimeError) as exc:
        raise HeadsMismatch(f"{weights_path} does not hold {meta.num_heads} heads of size "
                            f"{meta.hidden_size}: {exc}") from None
    _check_vocab(weights_path, vocab, meta.proposal_vocab, vocab_size)
    heads_id = hashlib.blake2b(weights_path.read_bytes(), digest_size=16).hexdigest()
    return (heads.to(device=device, dtype=dtype).eval(), meta, heads_id,
            None if vocab is None else vocab.to(device))


def _check_vocab(path: Path, vocab: torch.Tensor | None, size: int, vocab_size: int) -> None:
    """HeadsMismatch unless `vocab` is what heads.json says (`size` ids; None for 0): distinct
    sorted ids of the output layer's `vocab_size` rows."""
    if vocab is None:
        if size:
            raise HeadsMismatch(f"{path} holds no {PROPOSAL_VOCAB_KEY} though {META_FILE} says {size} ids")
        return
    if vocab.dim() != 1 or vocab.dtype != torch.int64 or vocab.numel() != size:
        raise HeadsMismatch(f"{path}: {PROPOSAL_VOCAB_KEY} is not {size} int64 ids as {META_FILE} says")
    if size and (int(vocab[0]) < 0 or int(vocab[-1]) >= vocab_size or not bool((vocab[1:] > vocab[:-1]).all())):
        raise HeadsMismatch(f"{path}: {PROPOSAL_VOCAB_KEY} is not distinct sorted ids below this model's "
                            f"vocabulary of {vocab_size}")
