"""The training loop: the draft (all its weights, or LoRA adapters through peft) pulled towards
the target's top-k distributions, batch by batch, checkpointed so a run can resume.

Batches are a function of the step: step s takes the windows at positions s·B .. s·B + B − 1 of
an endless sequence of shuffles (shuffle e seeded with seed + e), so a resumed run sees exactly
the batches the interrupted one would have.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.distill.objectives import Loss, TopK, per_position, training_loss
from specdec.distill.prepare import Prepared, pad

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"


@dataclass(frozen=True)
class TrainSettings:
    """How the draft is trained."""

    steps: int           # optimizer steps in all (a resumed run goes on to this many)
    batch_size: int      # windows per step
    lr: float            # AdamW's peak learning rate (linear warm-up, then linear decay to 0)
    loss: Loss           # forward KL or total variation
    temperature: float   # the distributions matched are softmax(logits / temperature)
    lora_rank: int = 0   # 0: every weight trains; r > 0: LoRA adapters of rank r on every linear layer
    lora_alpha: float = 0.0  # LoRA's scale numerator (0: 2·rank)
    seed: int = 0        # the batches' shuffles
    checkpoint_every: int = 100  # steps between checkpoints (and at the end)
    warmup: int = 0      # steps of linear learning-rate warm-up (0: none)


def with_lora(model: Any, rank: int, alpha: float) -> Any:
    """The model with LoRA adapters (rank `rank`) on every linear layer but the output head;
    only the adapters train. Needs peft (pip install 'specdec[distill]')."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise RuntimeError("--lora-rank needs peft: pip install 'specdec[distill]' (or pip install peft)") from exc
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules="all-linear", lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def merged(model: Any) -> Any:
    """A plain transformers model again: LoRA adapters merged into the weights."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


class Trainer:
    """Trains `model` on `data` under `settings`; `folder` holds its checkpoint."""

    def __init__(self, model: Any, data: Prepared, settings: TrainSettings, folder: Path, device: torch.device):
        self.model, self.data, self.settings, self.folder, self.device = model, data, settings, folder, device
        self.model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=0.0)
        self.step = 0
        self.losses: list[float] = []  # the loss of every step taken (a resumed run's included)
        self._orders: dict[int, torch.Tensor] = {}

    # ---- checkpoints ----------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu() for name, p in self.model.named_parameters() if p.requires_grad}

    def save(self) -> None:
        state = {"step": self.step, "weights": self.trainable_state(), "optimizer": self.optimizer.state_dict(),
                 "losses": self.losses, "settings": self.comparable()}
        partial = self.folder / (STATE_FILE + ".partial")
        torch.save(state, partial)
        partial.replace(self.folder / STATE_FILE)

    def resume(self) -> bool:
        """Load the checkpoint (False: there is none). ValueError when it was made with other settings."""
        path = self.folder / STATE_FILE
        if not path.exists():
            return False
        state = torch.load(path, weights_only=True)
        if state["settings"] != self.comparable():
            raise ValueError(f"the checkpoint in {self.folder} was made with other settings ({state['settings']}); "
                             "run without --resume to start again, or with the same settings")
        missing = set(self.trainable_state()) - set(state["weights"])
        if missing:
            raise ValueError(f"the checkpoint in {self.folder} lacks {len(missing)} trained weights "
                             f"(for example {sorted(missing)[0]}): was it made with another --lora-rank?")
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in state["weights"]:
                    p.copy_(state["weights"][name].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.losses = int(state["step"]), list(state["losses"])
        return True

    # ---- steps ------------------------------------------------------------------------------------

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, TopK]:
        indices = self._indices(step)
        windows = [self.data.windows[i] for i in indices]
        ids, mask = pad(windows)
        length, k = ids.shape[1], self.data.targets[indices[0]].ids.shape[-1]
        top_ids = torch.zeros((len(indices), length, k), dtype=torch.long)
        top_probs = torch.zeros((len(indices), length, k), dtype=torch.float32)
        top_probs[..., 0] = 1.0  # padding: a certain id 0 (masked out of the loss)
        for row, i in enumerate(indices):
            target = self.data.targets[i]
            top_ids[row, :len(target.ids)], top_probs[row, :len(target.ids)] = target.ids, target.probs
        return ids.to(self.device), mask.to(self.device), TopK(top_ids, top_probs).to(self.device)

    def comparable(self) -> dict:
        """The settings a checkpoint must share with the run that resumes it."""
        return _comparable(self.settings)

    def rows(self) -> int:
        """How many items the batches are drawn from (windows)."""
        return len(self.data.windows)

    def _indices(self, step: int) -> list[int]:
        count, size = self.rows(), self.settings.batch_size
        out = []
        for position in range(step * size, (step + 1) * size):
            epoch, offset = divmod(position, count)
            if epoch not in self._orders:
                self._orders = {epoch: torch.randperm(count, generator=torch.Generator().manual_seed(
                    self.settings.seed + epoch))}
            out.append(int(self._orders[epoch][offset]))
        return out

    def _lr(self, step: int) -> float:
        """A linear warm-up over `warmup` steps, then a linear decay to 0 at the last step."""
        warmup, steps = self.settings.warmup, self.settings.steps
        if warmup and step < warmup:
            return self.settings.lr * (step + 1) / warmup
        return self.settings.lr * max(0.0, steps - step) / max(1, steps - warmup)

    def train_step(self) -> float:
        ids, mask, target = self._batch(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.step)
        logits = self.model(input_ids=ids, attention_mask=mask).logits[..., :self.data.vocab]
        loss = training_loss(per_position(logits, target, self.settings.loss, self.settings.temperature), mask)
        return self.descend(loss)

    def descend(self, loss: torch.Tensor) -> float:
        """One optimizer step down `loss` (gradients clipped to norm 1); its value, recorded.
        FloatingPointError when it is not finite."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss is {value} at step {self.step}: lower --lr")
        self.step += 1
        self.losses.append(value)
        return value

    def run(self, advance: Callable[[int, float], Any] = lambda n, loss: None) -> None:
        """Train up to settings.steps, checkpointing every checkpoint_every steps and at the end."""
        while self.step < self.settings.steps:
            loss = self.train_step()
            advance(1, loss)
            if self.step % self.settings.checkpoint_every == 0 or self.step == self.settings.steps:
                self.save()


def _comparable(settings: TrainSettings) -> dict:
    """The settings a checkpoint must share with the run that resumes it (not the step count)."""
    return {"batch_size": settings.batch_size, "loss": str(settings.loss), "lora_rank": settings.lora_rank,
            "temperature": settings.temperature, "seed": settings.seed}
