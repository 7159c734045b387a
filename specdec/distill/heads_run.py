"""One heads run, `specdec distill --heads K`: the target's pass over the data (or the one kept
in OUT/checkpoint with `resume`), the untrained heads' accuracy, training, the heads written to
OUT with save_heads, loaded back for the target with load_heads and measured again, and the
report (printed, in OUT/distill-report.json and in heads.json)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specdec.distill.heads_training import TOP_N, HeadsData, HeadsTrainer, accuracy, prepare_heads, \
    proposal_vocabulary, vocab_coverage
from specdec.distill.objectives import Loss
from specdec.distill.run import REPORT_FILE, DistillConfig, Progress, Report, _load, \
    read_sequences, resumed, start_run
from specdec.distill.trainer import TrainSettings
from specdec.runtime.heads import HeadsMeta, MedusaHeads, load_heads, save_heads, target_identity

log = logging.getLogger(__name__)

HEADS_LR = 1e-3      # --lr 0 with --heads (Medusa-1 trains its heads at 1e-3)
WRITTEN_DIR = "written"  # under the checkpoint folder: the heads written once and loaded back


@dataclass
class HeadsReport(Report):
    """What a heads run did, as written to OUT/distill-report.json and heads.json's report: the
    draft run's fields, where `data` counts positions, `before` is accuracy() of the untrained
    heads (each predicts the target's next token) and `after` that of the written heads, loaded
    back for the target, over the whole vocabulary; `served` is that accuracy as the target service
    proposes, among the proposal vocabulary's ids, with its size and held-out coverage."""

    served: dict = field(default_factory=dict)

    def table(self) -> str:
        """The report as printed."""
        lines = [f"trained {self.config['heads']} heads on {self.config['target']} -> {self.config['out']}",
                 f"  {self.steps} steps, loss {self.config['loss']}: {_fmt(self.loss_first)} -> "
                 f"{_fmt(self.loss_last)}; {self.data.get('positions', 0)} positions",
                 f"  on {self.data.get('held_out_positions', 0)} held-out positions (head k at t: the target's "
                 f"greedy token at t+k+1):",
                 f"    head  top-1 before -> after   top-{TOP_N} before -> after"]
        before = {h["head"]: h for h in self.before.get("heads", [])}
        for head in self.after.get("heads", []):
            was = before.get(head["head"], {})
            lines.append(f"    {head['head']:>4}  {_fmt(was.get('top1'))} -> {_fmt(head['top1'])}        "
                         f"{_fmt(was.get(f'top{TOP_N}'))} -> {_fmt(head[f'top{TOP_N}'])}")
        vocab = self.served.get("proposal_vocab", 0)
        if vocab:
            lines.append(f"  proposing from {vocab} ids ({self.served['held_out_coverage']:.2%} of the held-out "
                         f"tokens): top-1 " + " / ".join(_fmt(h["top1"]) for h in self.served["heads"]))
        lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _check(config: DistillConfig) -> None:
    """What --heads does not take (ValueError: the CLI's message)."""
    if config.draft:
        raise ValueError("--heads trains heads on the target itself: give no --draft")
    if config.lora_rank:
        raise ValueError("--heads trains the heads' own weights: --lora-rank is for drafts")
    if config.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {config.batch_size}")


def _data(config: DistillConfig, model, tokenizer, folder: Path, progress: Progress) -> HeadsData:
    """From the checkpoint when resuming, else the target's pass (saved there)."""
    found = resumed(config, HeadsData.load, folder)
    if found is not None:
        return found
    from specdec.runtime.loader import eos_token_ids

    started = time.perf_counter()
    eos = eos_token_ids(model, tokenizer)
    train, held, summary = read_sequences(config, model, tokenizer, eos, progress)
    data_seconds = time.perf_counter() - started
    data = prepare_heads(model, train, held, config.top_k, config.temperature, config.seq_len, progress)
    started = time.perf_counter()
    untrained = MedusaHeads(config.heads, data.hidden.shape[1], device=config.device)
    data.before = accuracy(untrained, model.get_output_embeddings(), data)
    data.summary = summary
    data.seconds = {"data": round(data_seconds, 2), **data.seconds,
                    "accuracy_before": round(time.perf_counter() - started, 2)}
    data.save(folder)
    return data


def distill_heads(config: DistillConfig) -> HeadsReport:
    """See the module docstring."""
    _check(config)
    out, folder, progress = start_run(config)
    started = time.perf_counter()
    target = _load(config.target, config.target_dtype, config.device)
    load_seconds = time.perf_counter() - started
    model, output_layer = target.model, target.model.get_output_embeddings()
    data = _data(config, model, target.tokenizer, folder, progress)
    settings = TrainSettings(steps=config.steps, batch_size=config.batch_size, lr=config.lr or HEADS_LR,
                             loss=Loss(config.loss), temperature=config.temperature, seed=config.seed,
                             checkpoint_every=max(1, config.checkpoint_every), warmup=config.warmup)
    heads = MedusaHeads(config.heads, data.hidden.shape[1], device=config.device)
    trainer = HeadsTrainer(heads, data, settings, folder, torch.device(config.device), output_layer,
                           config.head_vocab)
    if config.resume and trainer.resume():
        log.info("resumed at step %d of %d", trainer.step, settings.steps)
    started = time.perf_counter()
    trainer.run(progress("training", settings.steps, trainer.step))
    seconds = {"load": round(load_seconds, 2), **data.seconds, "train": round(time.perf_counter() - started, 2)}
    losses, counts = trainer.losses, trainer.softmax_ids
    del trainer
    started = time.perf_counter()
    identity = target_identity(model)
    meta = HeadsMeta(num_heads=config.heads, hidden_size=heads.hidden_size, target_identity=identity,
                     target_model_id=config.target)
    written = save_heads(folder / WRITTEN_DIR, heads, meta, proposal_vocabulary(data, config.proposal_vocab))
    loaded, meta, _, vocab_ids = load_heads(written, model, config.device, torch.float32)
    after = accuracy(loaded, output_layer, data)
    served = {"proposal_vocab": meta.proposal_vocab, "held_out_coverage": vocab_coverage(data, vocab_ids),
              **(after if vocab_ids is None else accuracy(loaded, output_layer, data, vocab_ids))}
    seconds["accuracy_after"] = round(time.perf_counter() - started, 2)
    report = HeadsReport(config={k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
                         data={"positions": data.positions, "held_out_sequences": len(data.held_hidden),
                               "held_out_positions": data.held_positions, **data.summary,
                               "softmax_ids_per_step": round(sum(counts) / len(counts)) if counts else None},
                         before=data.before, after=after, loss_first=_mean(losses[:10]),
                         loss_last=_mean(losses[-10:]), steps=len(losses), seconds=seconds, served=served)
    save_heads(out, loaded, replace(meta, report=report.to_json()), vocab_ids)
    (out / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if not config.keep_checkpoint:
        shutil.rmtree(folder, ignore_errors=True)
    return report
