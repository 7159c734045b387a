"""Medusa-style heads on the target (`specdec distill --heads K`): each head's accuracy on
held-out text before and after training, per objective, and what each stage took.

Usage:
  python bench/heads_accuracy.py --tiny --seeds 3                     # tiny targets: kl, ce and tv, greedy and sampled data
  python bench/heads_accuracy.py --loss kl,ce --steps 500             # the fetched real target (bf16), 3 heads
  python bench/heads_accuracy.py --loss kl --step-times 3             # ... and seconds a step at several --head-vocab
  python bench/heads_accuracy.py --target-model DIR --text a.py b.py  # another target, other text

Accuracy of head k at position t: its argmax is the target's greedy token at t + k + 1 (its
argmax at t + k), over the held-out positions; top-4: that token is among the head's four most
likely. "Before" is the untrained heads (each predicts what the target's own next-token head
does). The real run learns on --text (default: four modules of Python's standard library, code
the target did not write) and is measured on the target's greedy answers to the quick bench
prompts (bench/prompts.py), --eval-new-tokens each. The target runs once: every other objective
resumes from the first run's checkpoint (its target pass). bench/results/heads.json and
heads.txt (or heads-tiny.json) get the figures; --heads-out keeps the first objective's heads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prompts import QUICK  # noqa: E402

STDLIB_TEXT = ("textwrap.py", "shlex.py", "graphlib.py", "bisect.py")  # about 10,200 tokens of Qwen2.5's


def tiny_setup(folder: Path, seed: int, answer_temperature: float) -> dict:
    """--tiny: a 12-token one-layer target 128 wide (seed `seed`), 640 training prompts of random
    words it answers at `answer_temperature` (0: greedily) and 24 held-out ones it answers greedily."""
    import random

    from specdec_cli import tiny

    tokenizer = tiny.word_tokenizer(12)
    target = tiny.build_model(folder / f"target-{seed}", tokenizer, "llama", seed=seed, layers=1, width=128,
                              init_std=0.6)
    rng = random.Random(seed)
    files = {}
    for name, count in (("train", 640), ("held-out", 24)):
        files[name] = folder / f"{name}-{seed}.txt"
        files[name].write_text("".join(" ".join(f"w{rng.randint(1, 11)}" for _ in range(rng.randint(2, 6))) + "\n"
                                       for _ in range(count)))
    return {"target": str(target), "draft": "", "prompts": (str(files["train"]),),
            "eval_prompts": str(files["held-out"]), "steps": 600, "lr": 1e-2, "batch_size": 256, "seq_len": 64,
            "max_new_tokens": 32, "eval_new_tokens": 32, "generate_temperature": answer_temperature,
            "target_dtype": "float32", "heads": 3}


def _row(report: dict) -> dict:
    return {"before": {h["head"]: h["top1"] for h in report["before"]["heads"]},
            "after": {h["head"]: h["top1"] for h in report["after"]["heads"]},
            "after_top4": {h["head"]: h["top4"] for h in report["after"]["heads"]},
            "positions": report["data"]["held_out_positions"], "seconds": report["seconds"]}


def tiny_runs(args: argparse.Namespace, work: Path) -> int:
    """--tiny: per target seed and training data (greedy or sampled answers), each objective."""
    import torch

    from specdec.distill.heads_run import distill_heads
    from specdec.distill.run import DistillConfig

    torch.set_num_threads(1)
    rows = []
    for seed in range(11, 11 + args.seeds):
        for data, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            setup = tiny_setup(work, seed, temperature)
            for loss in args.loss.split(","):
                report = distill_heads(DistillConfig(out=str(work / f"out-{seed}-{data}-{loss}"), loss=loss,
                                                     progress=False, **setup)).to_json()
                rows.append({"seed": seed, "data": data, "loss": loss, **_row(report)})
                print(f"seed {seed} {data} {loss}: top-1 " + ", ".join(
                    f"head {k} {rows[-1]['before'][k]:.3f} -> {rows[-1]['after'][k]:.3f}" for k in rows[-1]["after"]),
                    flush=True)
    lines = []
    for data in ("greedy", "sampled"):
        for loss in args.loss.split(","):
            mine = [r for r in rows if r["loss"] == loss and r["data"] == data]
            heads = sorted(mine[0]["after"])
            lines.append(f"{data} answers, {loss}: mean top-1 after " + ", ".join(
                f"head {k} {sum(r['after'][k] for r in mine) / len(mine):.3f}" for k in heads)
                + " (before " + ", ".join(f"{sum(r['before'][k] for r in mine) / len(mine):.3f}" for k in heads)
                + f") over {len(mine)} seeds")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heads-tiny.json").write_text(json.dumps({"rows": rows, "summary": lines}, indent=2) + "\n")
    print(f"wrote {out / 'heads-tiny.json'}")
    return 0


def step_times(first: Path, target: str, args: argparse.Namespace) -> dict:
    """Seconds per training step (and ids its softmax ran over) at each --step-vocab, on the data
    of the run in `first` (its kept checkpoint), from untrained heads."""
    import torch

    from specdec.distill.heads_training import HeadsData, HeadsTrainer
    from specdec.distill.objectives import Loss
    from specdec.distill.run import CHECKPOINT_DIR
    from specdec.distill.trainer import TrainSettings
    from specdec.runtime.heads import MedusaHeads
    from specdec.runtime.loader import load_model

    data = HeadsData.load(first / CHECKPOINT_DIR)
    layer = load_model(target, args.target_dtype, args.device).model.get_output_embeddings()
    out = {}
    for vocab in (int(v) for v in args.step_vocab.split(",")):
        settings = TrainSettings(steps=args.step_times + 1, batch_size=args.batch_size, lr=1e-3, loss=Loss.KL,
                                 temperature=1.0)
        heads = MedusaHeads(args.heads, data.hidden.shape[1], device=args.device)
        trainer = HeadsTrainer(heads, data, settings, Path(tempfile.mkdtemp()), torch.device(args.device), layer, vocab)
        trainer.train_step()  # warm-up
        started = time.perf_counter()
        for _ in range(args.step_times):
            trainer.train_step()
        out[str(vocab)] = {"seconds_per_step": round((time.perf_counter() - started) / args.step_times, 3),
                           "softmax_ids": round(sum(trainer.softmax_ids[1:]) / args.step_times)}
        print(f"--head-vocab {vocab}: {out[str(vocab)]}", flush=True)
    return out


def eval_prompts(folder: Path) -> Path:
    path = folder / "held-out.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in p.messages]}) + "\n"
                            for p in QUICK))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", default="")
    parser.add_argument("--tiny", action="store_true", help="tiny random targets built here (seconds a run)")
    parser.add_argument("--seeds", type=int, default=1, help="--tiny: this many target seeds (11, 12, ...)")
    parser.add_argument("--loss", default="kl,ce,tv", help="objectives, comma-separated (the first one's heads "
                                                          "are kept with --heads-out)")
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=256, help="positions per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.0, help="0: specdec distill's default for heads")
    parser.add_argument("--head-vocab", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--text", nargs="+", default=[], help="training text (default: Python stdlib modules)")
    parser.add_argument("--eval-new-tokens", type=int, default=96)
    parser.add_argument("--step-times", type=int, default=0, help="then time this many steps at each --step-vocab "
                                                                   "on the first run's data")
    parser.add_argument("--step-vocab", default="0,2048,8192,32768", help="--head-vocab values --step-times times")
    parser.add_argument("--heads-out", default="", help="also copy the first objective's heads directory here")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()

    from specdec.distill.heads_training import HEADS_PREPARED_FILE
    from specdec.distill.heads_run import distill_heads
    from specdec.distill.run import CHECKPOINT_DIR, DistillConfig

    work = Path(tempfile.mkdtemp(prefix="specdec-heads-"))
    if args.tiny:
        return tiny_runs(args, work)
    if args.target_model:
        target = args.target_model
    else:
        from specdec_cli.model_pair import FetchError, default_pair

        try:
            target = str(default_pair()["target"])
        except FetchError as exc:
            raise SystemExit(f"bench/heads_accuracy.py: {exc} (or give --target-model, or --tiny)")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = args.text or [str(stdlib / name) for name in STDLIB_TEXT if (stdlib / name).exists()]
    base = DistillConfig(target=target, draft="", out="", text=tuple(text), eval_prompts=str(eval_prompts(work)),
                         heads=args.heads, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                         lr=args.lr, head_vocab=args.head_vocab, top_k=args.top_k, target_dtype=args.target_dtype,
                         device=args.device, eval_new_tokens=args.eval_new_tokens,
                         checkpoint_every=max(50, args.steps // 4), keep_checkpoint=True)
    runs, first, started = {}, None, time.perf_counter()
    for loss in args.loss.split(","):
        out = work / f"heads-{loss}"
        if first is not None:  # the first run's target pass, not run again
            (out / CHECKPOINT_DIR).mkdir(parents=True)
            shutil.copy(first / CHECKPOINT_DIR / HEADS_PREPARED_FILE, out / CHECKPOINT_DIR / HEADS_PREPARED_FILE)
        report = distill_heads(replace(base, loss=loss, out=str(out), resume=first is not None)).to_json()
        runs[loss] = report
        first = first or out
        print("\n".join(f"{loss}: head {h['head']} top-1 {b['top1']:.4f} -> {h['top1']:.4f}, top-4 "
                        f"{b['top4']:.4f} -> {h['top4']:.4f}"
                        for b, h in zip(report["before"]["heads"], report["after"]["heads"]))
              + f"\n{loss}: seconds {report['seconds']}", flush=True)
    steps = step_times(first, target, args) if args.step_times and first is not None else {}
    if args.heads_out and first is not None:
        shutil.rmtree(args.heads_out, ignore_errors=True)
        shutil.copytree(first, args.heads_out, ignore=shutil.ignore_patterns(CHECKPOINT_DIR))
    document = {"target": target, "text": text, "args": vars(args), "runs": runs, "step_seconds": steps,
                "wall_seconds": round(time.perf_counter() - started, 1), "threads": os.cpu_count()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heads.json").write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    lines = ["objective  head  top-1 before -> after  top-4 before -> after"]
    for loss, report in runs.items():
        for b, h in zip(report["before"]["heads"], report["after"]["heads"]):
            lines.append(f"{loss:<9}  {h['head']:>4}  {b['top1']:.4f} -> {h['top1']:.4f}        "
                         f"{b['top4']:.4f} -> {h['top4']:.4f}")
    (out / "heads.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'heads.json'}, {out / 'heads.txt'}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
