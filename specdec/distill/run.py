"""One distillation run, `specdec distill`: prepare the data with the target, measure the draft,
train it, save it as a directory `specdec serve draft --model` loads, measure it again from
that directory, and report.

The checkpoint folder (OUT/checkpoint) holds the prepared data and the training state; a run
with `resume` picks up where an interrupted one stopped (no target pass again) and one without
starts over. It is removed once the run has finished, unless `keep_checkpoint`.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specdec.distill import data as sources
from specdec.distill.evaluate import Alignment, alignment
from specdec.distill.objectives import Loss
from specdec.distill.prepare import Prepared, prepare
from specdec.distill.trainer import Trainer, TrainSettings, merged, with_lora

log = logging.getLogger(__name__)

REPORT_FILE = "distill-report.json"
CHECKPOINT_DIR = "checkpoint"


@dataclass(frozen=True)
class DistillConfig:
    """What `specdec distill` was asked for (its flags)."""

    target: str                       # the target model (directory, hub id or .gguf file)
    draft: str                        # the draft to start from ("" with heads)
    out: str                          # where the distilled draft (or the heads) is written
    records: str = ""                 # a coordinator's records: a directory or file, or a Redis URL
    records_stream: str = ""          # with `records` a Redis URL: the stream's key
    text: tuple[str, ...] = ()        # text files, each one sequence
    prompts: tuple[str, ...] = ()     # prompts files the target answers, read in this order
    eval_prompts: str = ""            # held-out prompts the target answers (else part of the data)
    held_out: float = 0.1             # the fraction of the sequences held out when no eval_prompts
    loss: str = Loss.KL               # kl or tv
    top_k: int = 32                   # the target's distribution kept as this many ids (+ the rest)
    temperature: float = 1.0          # the distributions matched: softmax(logits / temperature)
    steps: int = 1000                 # optimizer steps
    batch_size: int = 8               # windows per step
    seq_len: int = 256                # longest window
    lr: float = 0.0                   # 0: 2e-5 for every weight, 2e-4 for LoRA
    warmup: int = 0                   # steps of learning-rate warm-up
    lora_rank: int = 0                # 0: full fine-tune; r: LoRA adapters of rank r
    lora_alpha: float = 0.0           # LoRA's alpha (0: 2·rank)
    device: str = "cpu"               # torch device of both models
    dtype: str = "float32"            # the draft's dtype while it trains
    target_dtype: str = "float32"     # the target's
    save_dtype: str = ""              # the written draft's weights ("": the draft's own dtype)
    max_new_tokens: int = 128         # prompts: tokens the target answers each with
    generate_temperature: float = 1.0  # prompts: 0 greedy, else sampled at this temperature
    eval_new_tokens: int = 128        # eval prompts: tokens the target answers each with (greedy)
    proposal_top_k: int = 32          # the draft service's --proposal-top-k (sampled α)
    checkpoint_every: int = 100       # steps between checkpoints
    resume: bool = False              # go on from OUT/checkpoint
    keep_checkpoint: bool = False     # keep OUT/checkpoint after a finished run
    seed: int = 0                     # shuffles and sampled answers
    progress: bool = True             # tqdm progress bars
    heads: int = 0                    # K > 0: train K Medusa-style heads on the target, no draft
    head_vocab: int = 8192            # heads: ids a step's softmax runs over (0: the whole vocabulary)
    proposal_vocab: int = 32768       # heads: the ids they propose from, the data's commonest (0: all)


@dataclass
class Report:
    """What a run did, as written to OUT/distill-report.json."""

    config: dict
    data: dict                  # windows, positions, held-out sequences and positions, sources
    before: dict                # Alignment.to_json() of the draft as given
    after: dict                 # ... of the written draft, loaded back from OUT
    loss_first: float | None    # mean loss of the first 10 steps (loss_ends: fewer in a short run)
    loss_last: float | None     # mean loss of the last 10 steps
    steps: int                  # steps trained in all
    seconds: dict = field(default_factory=dict)  # per stage: prepare, teacher, alpha_before, train, ...

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """The report as printed."""
        modes = sorted(set(self.before.get("alpha", {})) | set(self.after.get("alpha", {})))
        lines = [f"distilled {self.config['draft']} towards {self.config['target']} -> {self.config['out']}",
                 f"  {self.steps} steps, loss {self.config['loss']}: {_fmt(self.loss_first)} -> {_fmt(self.loss_last)}; "
                 f"{self.data.get('windows', 0)} windows ({self.data.get('positions', 0)} positions)",
                 f"  α on {self.after.get('positions', self.before.get('positions', 0))} held-out positions:"]
        for mode in modes:
            before, after = self.before.get("alpha", {}).get(mode), self.after.get("alpha", {}).get(mode)
            lines.append(f"    {mode:<12} {_fmt(before)} -> {_fmt(after)}")
        lines.append("  seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


Progress = Callable[[str, int], Callable[..., Any]]


def tqdm_progress(enabled: bool) -> tuple[Progress, list]:
    """progress(stage, total) -> advance(n, loss=None), drawing one tqdm bar per stage."""
    from tqdm.auto import tqdm

    bars: list = []

    def progress(stage: str, total: int, initial: int = 0) -> Callable[..., Any]:
        bar = tqdm(total=total, initial=initial, desc=stage, disable=not enabled, dynamic_ncols=True)
        bars.append(bar)

        def advance(n: int, loss: float | None = None) -> None:
            bar.update(n)
            if loss is not None:
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if bar.n >= bar.total:
                bar.close()
        return advance
    return progress, bars


def _load(spec: str, dtype: str, device: str) -> Any:
    from specdec.runtime.loader import load_model

    return load_model(spec, dtype, device)


def read_sequences(config: DistillConfig, target: Any, tokenizer: Any, eos: tuple[int, ...],
               progress: Progress) -> tuple[list[list[int]], list[sources.Scored], dict]:
    """(training sequences, held-out sequences, where they came from)."""
    train: list[list[int]] = []
    summary: dict = {}
    if config.records:
        recorded = sources.read_recorded(config.records, config.records_stream)
        summary["recorded_sequences"] = len(recorded)
        train += recorded
    if config.text:
        text = sources.read_text(config.text, tokenizer)
        summary["text_sequences"] = len(text)
        train += text
    prompts = sources.read_prompt_files(config.prompts, tokenizer)
    if not (train or prompts):
        raise ValueError("nothing to learn from: give --records, --text or --prompts")
    started = time.perf_counter()
    if config.eval_prompts:
        eval_prompts = sources.read_prompts(config.eval_prompts, tokenizer)
        held = sources.generate(target, eval_prompts, config.eval_new_tokens, 0.0, config.seed, eos,
                                progress("held-out answers", len(eval_prompts)))
    else:
        train, held_text = sources.split_held_out(train, config.held_out)
        prompts, held_prompts = sources.split_held_out(prompts, config.held_out)
        held = [sources.Scored(seq, 1) for seq in held_text] + sources.generate(
            target, held_prompts, config.eval_new_tokens, 0.0, config.seed, eos,
            progress("held-out answers", len(held_prompts)))
    summary["held_out_seconds"] = round(time.perf_counter() - started, 2)
    started = time.perf_counter()
    if prompts:
        answered = sources.generate(target, prompts, config.max_new_tokens, config.generate_temperature,
                                    config.seed, eos, progress("target answers", len(prompts)))
        summary["prompts"] = len(prompts)
        summary["answer_seconds"] = round(time.perf_counter() - started, 2)
        summary["answer_tokens"] = sum(len(s.tokens) - s.start for s in answered)
        train += [s.tokens for s in answered]
    if not held:
        raise ValueError("no held-out text to measure α on: give --eval-prompts, or more sequences with --held-out > 0")
    return train, held, summary


def resumed(config: DistillConfig, load: Callable[[Path], Any], folder: Path) -> Any:
    """With --resume, the prepared data `load` finds in the checkpoint `folder` (None: start
    afresh, as without --resume)."""
    if not config.resume:
        return None
    found = load(folder)
    if found is not None:
        log.info("resuming from %s", folder)
    return found


def _prepare(config: DistillConfig, folder: Path, progress: Progress) -> Prepared:
    """The prepared data: from the checkpoint when resuming, else made with the target (which is
    freed afterwards) and saved there."""
    found = resumed(config, Prepared.load, folder)
    if found is not None:
        return found
    from specdec.runtime.loader import eos_token_ids

    started = time.perf_counter()
    target = _load(config.target, config.target_dtype, config.device)
    eos = eos_token_ids(target.model, target.tokenizer)
    train, held, summary = read_sequences(config, target.model, target.tokenizer, eos, progress)
    generated = time.perf_counter() - started
    draft = _load(config.draft, config.dtype, config.device)
    vocab = min(target.model.config.vocab_size, draft.model.config.vocab_size)
    prepared = prepare(target.model, train, held, vocab, config.top_k, config.temperature, config.seq_len,
                       config.batch_size, progress)
    started = time.perf_counter()
    prepared.alpha_before = alignment(draft.model, target.model, held, config.proposal_top_k).to_json()
    prepared.summary = summary
    prepared.seconds = {"data": round(generated, 2), **prepared.seconds,
                        "alpha_before": round(time.perf_counter() - started, 2)}
    prepared.save(folder)
    return prepared


def _save_dtype(config: DistillConfig) -> torch.dtype:
    """The written draft's dtype: the flag's, else what the draft's config names, else float32."""
    from transformers import AutoConfig

    from specdec.runtime.loader import TORCH_DTYPES
    from specdec.tokenizer import model_source

    if config.save_dtype:
        return TORCH_DTYPES[config.save_dtype]
    try:
        source, extra = model_source(config.draft)
        named = getattr(AutoConfig.from_pretrained(source, **extra), "dtype", None)
    except (OSError, ValueError):
        named = None
    named = str(named).removeprefix("torch.") if named is not None else ""
    return TORCH_DTYPES.get(named, torch.float32)


def start_run(config: DistillConfig) -> tuple[Path, Path, Progress]:
    """A run's output directory, its checkpoint folder (emptied unless resuming) and its
    progress bars; the seed set."""
    out = Path(config.out)
    folder = out / CHECKPOINT_DIR
    if not config.resume and folder.exists():
        shutil.rmtree(folder)
    progress, _ = tqdm_progress(config.progress)
    torch.manual_seed(config.seed)
    return out, folder, progress


def distill(config: DistillConfig) -> Report:
    """See the module docstring."""
    out, folder, progress = start_run(config)
    prepared = _prepare(config, folder, progress)
    lora = config.lora_rank > 0
    settings = TrainSettings(steps=config.steps, batch_size=config.batch_size,
                             lr=config.lr or (2e-4 if lora else 2e-5), loss=Loss(config.loss),
                             temperature=config.temperature, lora_rank=config.lora_rank,
                             lora_alpha=config.lora_alpha, seed=config.seed,
                             checkpoint_every=max(1, config.checkpoint_every), warmup=config.warmup)
    draft = _load(config.draft, config.dtype, config.device)
    model = with_lora(draft.model, config.lora_rank, config.lora_alpha) if lora else draft.model
    trainer = Trainer(model, prepared, settings, folder, torch.device(config.device))
    if config.resume and trainer.resume():
        log.info("resumed at step %d of %d", trainer.step, settings.steps)
    started = time.perf_counter()
    trainer.run(progress("training", settings.steps, trainer.step))
    seconds = {**prepared.seconds, "train": round(time.perf_counter() - started, 2)}
    losses = trainer.losses
    started = time.perf_counter()
    trained = merged(trainer.model).to(_save_dtype(config))
    trained.save_pretrained(out)
    draft.tokenizer.save_pretrained(out)
    del trained, trainer, model, draft
    seconds["save"] = round(time.perf_counter() - started, 2)
    started = time.perf_counter()
    written, target = _load(str(out), config.dtype, config.device), _load(config.target, config.target_dtype, config.device)
    after: Alignment = alignment(written.model, target.model, prepared.held_out, config.proposal_top_k)
    seconds["alpha_after"] = round(time.perf_counter() - started, 2)
    report = Report(config={k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
                    data={"windows": len(prepared.windows), "positions": prepared.positions,
                          "held_out_sequences": len(prepared.held_out), **prepared.summary},
                    before=prepared.alpha_before, after=after.to_json(),
                    loss_first=loss_ends(losses)[0], loss_last=loss_ends(losses)[1], steps=len(losses),
                    seconds=seconds)
    (out / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if not config.keep_checkpoint:
        shutil.rmtree(folder, ignore_errors=True)
    return report


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


LOSS_WINDOW = 10  # steps whose mean loss the report shows at each end of a run


def loss_ends(losses: list[float]) -> tuple[float | None, float | None]:
    """(mean loss of the first steps, of the last steps): LOSS_WINDOW steps each, fewer in a short
    run so the two never share a step (5 steps: the first 2 and the last 2; 1 step: that one)."""
    window = max(1, min(LOSS_WINDOW, len(losses) // 2))
    return _mean(losses[:window]), _mean(losses[-window:])
