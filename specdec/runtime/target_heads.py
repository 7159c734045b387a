"""The heads an engine serves (`serve target --heads DIR`): loaded with the model, read in Verify.

Medusa-style heads (heads.py) take the target's last hidden state — what its output layer
takes — at the position whose logits chose a round's next token, and propose the tokens after
it. An engine with heads hands out those hidden states beside the logits (`forward_hidden`,
engine.py); the verifier reads one row per call that asks (`VerifyCall.head_candidates`) and
runs every such row of a batch through the heads in one call (`TargetHeads.proposals`).

What this module decides:
- Heads are loaded with the model, before its linear layers are packed or quantized: their
  identity check reads the plain output layer's weights (loader.py calls `load_for`).
- The heads share the engine's own output layer (the torch engine's module, packed or not; the
  graph engine's head matrix), so their logits are what the target's head makes of their states.
  Heads with a proposal vocabulary (heads.py) get their own copy of that layer's rows for those
  ids (`ProposalVocab`: n × hidden more weights, taken from the plain layer at load and packed
  with the model's linears), so a Verify reads that slice instead of the whole layer.
- The torch engine captures the output layer's input with a forward pre-hook
  (`OutputLayerInputs`), registered only while heads are loaded.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specdec.runtime.heads import HeadsMeta, MedusaHeads, head_proposals, load_heads
from specdec.types import ModelDescription, SparseDist

log = logging.getLogger(__name__)


class ProposalVocab(torch.nn.Module):
    """The ids heads propose from and the output layer's rows for them: logits over those ids."""

    def __init__(self, ids: torch.Tensor, output_layer: torch.nn.Module):
        super().__init__()
        self.register_buffer("ids", ids)  # [n] int64, sorted
        bias = getattr(output_layer, "bias", None)
        weight = output_layer.weight.detach()  # [vocab, hidden], the plain layer (before packing)
        self.layer = torch.nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None,
                                     device=weight.device, dtype=weight.dtype)  # [hidden] -> [n]
        with torch.no_grad():
            self.layer.weight.copy_(weight[ids])
            if bias is not None:
                self.layer.bias.copy_(bias.detach()[ids])

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., hidden] -> logits over the ids [..., n]."""
        return self.layer(states)


@dataclass(frozen=True)
class LoadedHeads:
    """What the loader loads with the model for --heads."""

    heads: MedusaHeads  # K residual blocks on the engine's device in its dtype
    meta: HeadsMeta     # heads.json
    heads_id: str       # a digest of their weights file
    vocab: ProposalVocab | None  # None: they propose from the whole vocabulary


def load_for(directory: str, model: Any, device: torch.device, dtype: torch.dtype) -> LoadedHeads:
    """The heads in `directory` for a freshly loaded transformers model (HeadsMismatch when they
    belong to another model), on the engine's device in its dtype."""
    heads, meta, heads_id, ids = load_heads(directory, model, device, dtype)
    vocab = None if ids is None else ProposalVocab(ids, model.get_output_embeddings())
    log.info("heads %s: %d heads for %s (identity %s), proposing from %s", directory, meta.num_heads,
             meta.target_model_id, heads_id, "the whole vocabulary" if vocab is None else f"{ids.numel()} ids")
    return LoadedHeads(heads, meta, heads_id, vocab)


@dataclass(frozen=True)
class TargetHeads:
    """Loaded heads and the output layer they share with the target."""

    heads: MedusaHeads  # K residual blocks, head 1 first, on the engine's device in its dtype
    output_layer: Callable[[torch.Tensor], torch.Tensor]  # [..., hidden] -> logits [..., vocab or n]: the
    #                                                      target's, or its rows for the proposal vocabulary
    meta: HeadsMeta  # heads.json
    heads_id: str  # a digest of their weights file (ModelInfo.heads_id)

    @classmethod
    def of(cls, loaded: LoadedHeads | None, output_layer: Callable[[torch.Tensor], torch.Tensor]
           ) -> "TargetHeads | None":
        """The engine's heads from what the loader loaded (None: no --heads); `output_layer` is the
        engine's, which heads with a proposal vocabulary leave for their own rows of it."""
        if loaded is None:
            return None
        layer = output_layer if loaded.vocab is None else loaded.vocab
        return cls(loaded.heads, layer, loaded.meta, loaded.heads_id)

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[n] the ids output_layer's logits are for (None: the whole vocabulary)."""
        return self.output_layer.ids if isinstance(self.output_layer, ProposalVocab) else None

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def describe(self, description: ModelDescription) -> ModelDescription:
        """The engine's description with its heads (GetModelInfo's num_heads, heads_id)."""
        return dataclasses.replace(description, num_heads=self.num_heads, heads_id=self.heads_id)

    def proposals(self, hidden: torch.Tensor, candidates: Sequence[int]) -> list[tuple[SparseDist, ...]]:
        """hidden [rows, hidden] (one row per call), candidates per row -> per row, per head (head 1
        first) its `candidates` most likely tokens; one host read for the batch."""
        return head_proposals(self.heads, self.output_layer, hidden, candidates, self.vocab_ids)


class OutputLayerInputs:
    """A forward pre-hook on a module (the torch engine's output layer) keeping what it takes
    (HF models hand it the kept positions only: [B, keep, hidden]); `take` hands the last one over."""

    def __init__(self, layer: torch.nn.Module):
        self.taken: torch.Tensor | None = None  # the last input, until taken
        self.handle = layer.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.taken = args[0] if args else next(iter(kwargs.values()))

    def take(self) -> torch.Tensor:
        """The output layer's input of the last forward -> [B, keep, hidden] (once)."""
        taken, self.taken = self.taken, None
        if taken is None:
            raise RuntimeError("the output layer ran no forward since its input was last taken")
        return taken

    def remove(self) -> None:
        self.handle.remove()
