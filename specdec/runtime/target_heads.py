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

LoadedHeads = tuple[MedusaHeads, HeadsMeta, str]  # load_heads' result: the module, its meta, its identity


def load_for(directory: str, model: Any, device: torch.device, dtype: torch.dtype) -> LoadedHeads:
    """The heads in `directory` for a freshly loaded transformers model (HeadsMismatch when they
    belong to another model), on the engine's device in its dtype."""
    heads, meta, heads_id = load_heads(directory, model, device, dtype)
    log.info("heads %s: %d heads for %s (identity %s)", directory, meta.num_heads, meta.target_model_id, heads_id)
    return heads, meta, heads_id


@dataclass(frozen=True)
class TargetHeads:
    """Loaded heads and the output layer they share with the target."""

    heads: MedusaHeads  # K residual blocks, head 1 first, on the engine's device in its dtype
    output_layer: Callable[[torch.Tensor], torch.Tensor]  # the target's: [..., hidden] -> logits [..., vocab]
    meta: HeadsMeta  # heads.json
    heads_id: str  # a digest of their weights file (ModelInfo.heads_id)

    @classmethod
    def of(cls, loaded: LoadedHeads | None, output_layer: Callable[[torch.Tensor], torch.Tensor]
           ) -> "TargetHeads | None":
        """The engine's heads from what the loader loaded (None: no --heads)."""
        if loaded is None:
            return None
        heads, meta, heads_id = loaded
        return cls(heads, output_layer, meta, heads_id)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def describe(self, description: ModelDescription) -> ModelDescription:
        """The engine's description with its heads (GetModelInfo's num_heads, heads_id)."""
        return dataclasses.replace(description, num_heads=self.num_heads, heads_id=self.heads_id)

    def proposals(self, hidden: torch.Tensor, candidates: Sequence[int]) -> list[tuple[SparseDist, ...]]:
        """hidden [rows, hidden] (one row per call), candidates per row -> per row, per head (head 1
        first) its `candidates` most likely tokens; one host read for the batch."""
        return head_proposals(self.heads, self.output_layer, hidden, candidates)


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
