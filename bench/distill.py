"""Distilling the draft (`specdec distill`): α on the held-out bench prompts before and after,
what each stage took, and optionally the speed-up through the services.

Usage:
  python bench/distill.py --tiny --loss both --seeds 5             # tiny pairs: kl against tv, in seconds
  python bench/distill.py --steps 40 --lora-rank 16 --dtype bfloat16   # the fetched real pair, a short run
  python bench/distill.py --loss both                              # kl and tv from the same start
  python bench/distill.py --distilled DIR --no-train --speedup     # a draft distilled before, through `specdec up`
  python bench/distill.py --distilled DIR --no-train --alpha       # ... its α and the original's, all ten prompts

The draft learns on the target's answers to TRAIN_PROMPTS below (tasks none of the bench prompts
ask), sampled at temperature 1, --train-new-tokens each. α is measured on the bench prompts
(bench/prompts.py: the quick ones with --quick), answered greedily by the target,
--eval-new-tokens each, through specdec/distill/evaluate.py: per position Σ min(p, q), greedy
and sampled at temperature 1. --speedup serves the original and the distilled draft in turn
(`specdec up`, torch engine) and generates the quick prompts greedily, target-only and
adaptive: tokens/s and speed-up over target-only per prompt. bench/results/distill.json and
distill.txt get the figures, and an estimate of a full run's time from the measured rates.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prompts import PROMPTS, QUICK, SYSTEM  # noqa: E402

TRAIN_PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a bank account with deposit, withdraw and a transaction history.",
    "Implement binary search in Python and explain its complexity.",
    "Write a function that parses a query string like 'a=1&b=2' into a dict, with tests.",
    "Write a Python script that counts word frequencies in a text file and prints the top 10.",
    "Implement a stack and a queue in Python using lists, with type hints.",
    "Write a JavaScript function that debounces another function.",
    "Refactor this code to use a list comprehension: result = []\nfor x in data:\n    if x > 0:\n        result.append(x * 2)",
    "Explain what a Python decorator is, with an example that times a function.",
    "Write a SQL query that finds the three customers with the highest total order value.",
    "Write a function that validates an email address with a regular expression, and explain the pattern.",
    "Implement the sieve of Eratosthenes in Python.",
    "Write a Python dataclass for a 2D point with distance and midpoint methods.",
    "Explain the difference between a process and a thread.",
    "Write a function that flattens a nested list of arbitrary depth.",
    "Write a Python generator that yields the Fibonacci numbers.",
    "Summarise in three sentences why unit tests are useful.",
    "Write a bash script that backs up a directory into a dated tar.gz file.",
    "Implement a trie with insert and prefix search in Python.",
    "Write a function that converts a Roman numeral to an integer.",
    "Explain big-O notation to a beginner with three examples.",
    "Write a Python function that reads a CSV file and returns the average of one column.",
    "Implement quicksort in Python and add docstrings.",
    "Write a REST API endpoint in Flask that returns a list of users as JSON.",
)


def chat(content: str) -> dict:
    return {"messages": [{"role": SYSTEM[0], "content": SYSTEM[1]}, {"role": "user", "content": content}]}


def write_prompts(folder: Path, quick: bool, train_count: int) -> tuple[Path, Path]:
    """The training prompts and the held-out bench prompts as prompts files."""
    train, held = folder / "train.jsonl", folder / "held-out.jsonl"
    train.write_text("".join(json.dumps(chat(p)) + "\n" for p in TRAIN_PROMPTS[:train_count]))
    bench = QUICK if quick else PROMPTS
    held.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in p.messages]}) + "\n"
                            for p in bench))
    return train, held


def tiny_setup(folder: Path, seed: int) -> dict:
    """--tiny: a 12-token target of one layer, an unrelated draft of the same shape (draft seed
    `seed`), and prompts of random words (the bench prompts need a real tokenizer), with settings
    that learn in seconds (those of tests/service/test_distill.py)."""
    import random

    from specdec_cli import tiny

    tokenizer = tiny.word_tokenizer(12)
    target = tiny.build_model(folder / "target", tokenizer, "llama", seed=21, layers=1, init_std=0.15)
    draft = tiny.build_model(folder / f"draft-{seed}", tokenizer, "llama", seed=seed, layers=1, init_std=0.3)
    rng = random.Random(0)
    files = {}
    for name, count in (("train", 160), ("held-out", 24)):
        files[name] = folder / f"{name}.txt"
        files[name].write_text("".join(" ".join(f"w{rng.randint(1, 11)}" for _ in range(rng.randint(2, 6))) + "\n"
                                       for _ in range(count)))
    return {"draft": str(draft), "target": str(target), "prompts": (str(files["train"]),),
            "eval_prompts": str(files["held-out"]), "steps": 150, "lr": 2e-2, "batch_size": 8, "seq_len": 64,
            "max_new_tokens": 24, "eval_new_tokens": 24, "target_dtype": "float32", "dtype": "float32"}


def estimate(report: dict, full_prompts: int, new_tokens: int, epochs: float = 1.0, prompt_tokens: int = 100) -> dict:
    """A full run's hours on this machine from this run's rates per token: `full_prompts`
    training prompts of about `prompt_tokens` tokens answered with `new_tokens` each by the
    target, its top-k pass over them, and `epochs` passes of training over them (the same batch
    shape), plus the two α measurements as they were."""
    seconds, data, config = report["seconds"], report["data"], report["config"]
    window = data.get("positions", 0) / max(data.get("windows", 1), 1)  # mean tokens per window
    trained = report["steps"] * config["batch_size"] * window  # tokens the steps trained on
    per_train_token = seconds.get("train", 0.0) / max(trained, 1)
    per_answer_token = data.get("answer_seconds", 0.0) / max(data.get("answer_tokens", 1), 1)
    per_teacher_token = seconds.get("teacher", 0.0) / max(data.get("positions", 1), 1)
    tokens = full_prompts * (prompt_tokens + new_tokens)
    parts = {"answers": per_answer_token * full_prompts * new_tokens, "teacher": per_teacher_token * tokens,
             "train": per_train_token * tokens * epochs,
             "alpha": data.get("held_out_seconds", 0.0) + seconds.get("alpha_before", 0.0) + seconds.get("alpha_after", 0.0)}
    return {"seconds_per_step": round(seconds.get("train", 0.0) / max(report["steps"], 1), 2),
            "seconds_per_trained_token": round(per_train_token, 4),
            "seconds_per_answer_token": round(per_answer_token, 4),
            "seconds_per_teacher_token": round(per_teacher_token, 4),
            "full_prompts": full_prompts, "full_new_tokens": new_tokens, "full_epochs": epochs,
            "full_run_hours": {k: round(v / 3600, 2) for k, v in parts.items()},
            "full_run_hours_total": round(sum(parts.values()) / 3600, 1)}


def distilled_draft(args: argparse.Namespace, runs: dict, flag: str) -> str:
    """The distilled draft `flag` compares with the original: --distilled, else this run's first."""
    distilled = args.distilled or (str(Path(args.out) / f"distilled-{next(iter(runs))}") if runs else "")
    if not distilled:
        raise SystemExit(f"bench/distill.py: {flag} needs a distilled draft (a run, or --distilled DIR)")
    return distilled


def alphas(drafts: dict[str, str], target: str, held: Path, new_tokens: int, dtype: str, target_dtype: str,
           device: str) -> dict:
    """α of each draft (name -> checkpoint) on the target's greedy answers to the prompts in
    `held` (`new_tokens` each), through specdec/distill/evaluate.py as a distill run measures it."""
    from specdec.distill import data as sources
    from specdec.distill.evaluate import alignment
    from specdec.runtime.loader import eos_token_ids, load_model

    loaded = load_model(target, target_dtype, device)
    prompts = sources.read_prompts(held, loaded.tokenizer)
    answers = sources.generate(loaded.model, prompts, new_tokens, 0.0, 0, eos_token_ids(loaded.model, loaded.tokenizer))
    out = {}
    for name, checkpoint in drafts.items():
        out[name] = alignment(load_model(checkpoint, dtype, device).model, loaded.model, answers).to_json()
        print(f"{name}: α greedy {out[name]['alpha']['greedy']:.4f}, sampled {out[name]['alpha']['sampled_t1']:.4f} "
              f"on {out[name]['positions']} positions", flush=True)
    return out


def speedup(draft: str, target: str, prompts: list, new_tokens: int, port: int, dtype: str) -> dict:
    """Target-only and adaptive tokens/s per quick prompt through `specdec up` (torch engine)."""
    from bench.speedup import chat_ids, run_specdec
    from specdec.rpc.health import wait_healthy
    from specdec.tokenizer import load_tokenizer
    from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

    import grpc

    command = [sys.executable, "-m", "specdec_cli", "up", "--port", str(port), "--backend", "torch", "--dtype", dtype,
               "--draft-model", draft, "--target-model", target, "--http-port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, cwd=ROOT, env=dict(os.environ))
    tokenizer, rows = load_tokenizer(target), {}
    try:
        wait_healthy(f"127.0.0.1:{port}", 900, [proc])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            methods = {"target-only": {"proposer": coordinator_pb2.PROPOSER_NONE},
                       "auto": {"proposer": coordinator_pb2.PROPOSER_AUTO}}
            run_specdec(stub, chat_ids(tokenizer, prompts[0]), 16, methods["auto"])  # warm-up
            for prompt in prompts:
                ids = chat_ids(tokenizer, prompt)
                timed = {name: run_specdec(stub, ids, new_tokens, fields) for name, fields in methods.items()}
                tps = {name: t.decode_tokens_per_second for name, (t, _) in timed.items()}
                rows[prompt.name] = {"target_only_tps": round(tps["target-only"], 3), "auto_tps": round(tps["auto"], 3),
                                     "speedup": round(tps["auto"] / tps["target-only"], 3),
                                     "acceptance": timed["auto"][1].get("acceptance_rate")}
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def tiny_runs(args: argparse.Namespace, work: Path) -> int:
    """--tiny: per draft seed, each loss from the same start; a table of α after."""
    from specdec.distill.run import DistillConfig, distill

    rows = []
    for seed in range(26, 26 + args.seeds):
        setup = tiny_setup(work, seed)
        for loss in ("kl", "tv") if args.loss == "both" else (args.loss,):
            report = distill(DistillConfig(out=str(work / f"out-{seed}-{loss}"), loss=loss, progress=False,
                                           **setup)).to_json()
            rows.append({"seed": seed, "loss": loss, "before": report["before"]["alpha"],
                         "after": report["after"]["alpha"], "positions": report["after"]["positions"],
                         "train_seconds": report["seconds"]["train"]})
            print(f"draft seed {seed} {loss}: greedy {rows[-1]['before']['greedy']:.3f} -> "
                  f"{rows[-1]['after']['greedy']:.3f}, sampled {rows[-1]['before']['sampled_t1']:.3f} -> "
                  f"{rows[-1]['after']['sampled_t1']:.3f}", flush=True)
    for loss in sorted({r["loss"] for r in rows}):
        mine = [r for r in rows if r["loss"] == loss]
        print(f"{loss}: mean α after, greedy {sum(r['after']['greedy'] for r in mine) / len(mine):.3f}, "
              f"sampled {sum(r['after']['sampled_t1'] for r in mine) / len(mine):.3f} over {len(mine)} seeds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distill-tiny.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out / 'distill-tiny.json'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--tiny", action="store_true", help="tiny random pairs built here, prompts of random "
                                                           "words (seconds a run)")
    parser.add_argument("--seeds", type=int, default=1, help="--tiny: runs with this many draft seeds (26, 27, ...)")
    parser.add_argument("--quick", action="store_true", help="hold out the five quick bench prompts, not all ten")
    parser.add_argument("--loss", default="kl", choices=("kl", "tv", "both"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.0, help="0: specdec distill's default for the mode")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="the draft's while it trains, and the services'")
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--train-prompts", type=int, default=len(TRAIN_PROMPTS))
    parser.add_argument("--train-new-tokens", type=int, default=128)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--full-prompts", type=int, default=2000,
                        help="the full run the time estimate is for: this many training prompts ...")
    parser.add_argument("--full-new-tokens", type=int, default=256, help="... answered with this many tokens ...")
    parser.add_argument("--full-epochs", type=float, default=1.0, help="... trained on this many times")
    parser.add_argument("--distilled", default="", help="with --no-train: a draft distilled before (for --speedup)")
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--alpha", action="store_true", help="α of the original and the distilled draft on "
                                                             "the held-out prompts, the target's answers shared")
    parser.add_argument("--speedup", action="store_true", help="serve the original and the distilled draft in turn")
    parser.add_argument("--speedup-new-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=50081)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()

    from specdec.distill.run import DistillConfig, distill

    work = Path(tempfile.mkdtemp(prefix="specdec-distill-"))
    if args.tiny:
        return tiny_runs(args, work)
    if args.draft_model and args.target_model:
        draft, target = args.draft_model, args.target_model
    else:
        from specdec_cli.model_pair import FetchError, default_pair

        try:
            pair = default_pair()
        except FetchError as exc:
            raise SystemExit(f"bench/distill.py: {exc} (or give --draft-model/--target-model, or --tiny)")
        draft, target = str(pair["draft"]), str(pair["target"])
    train, held = write_prompts(work, args.quick, args.train_prompts)
    base = DistillConfig(target=target, draft=draft, out="", prompts=(str(train),), eval_prompts=str(held),
                         steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                         lora_rank=args.lora_rank, top_k=args.top_k, dtype=args.dtype,
                         target_dtype=args.target_dtype, device=args.device, max_new_tokens=args.train_new_tokens,
                         eval_new_tokens=args.eval_new_tokens, checkpoint_every=max(10, args.steps))
    runs, started = {}, time.perf_counter()
    for loss in ([] if args.no_train else ("kl", "tv") if args.loss == "both" else (args.loss,)):
        out = Path(args.out) / f"distilled-{loss}"
        report = distill(replace(base, loss=loss, out=str(out))).to_json()
        report["estimate"] = estimate(report, args.full_prompts, args.full_new_tokens, args.full_epochs)
        runs[loss] = report
        print(f"{loss}: α greedy {report['before']['alpha']['greedy']:.4f} -> {report['after']['alpha']['greedy']:.4f}, "
              f"sampled {report['before']['alpha']['sampled_t1']:.4f} -> {report['after']['alpha']['sampled_t1']:.4f} "
              f"on {report['after']['positions']} held-out positions; {report['steps']} steps; "
              f"seconds {report['seconds']}; full run ≈ {report['estimate']['full_run_hours_total']} h", flush=True)
    aligned = {}
    if args.alpha:
        aligned = alphas({"original": draft, "distilled": distilled_draft(args, runs, "--alpha")}, target, held,
                         args.eval_new_tokens, args.dtype, args.target_dtype, args.device)
    served = {}
    if args.speedup:
        distilled = distilled_draft(args, runs, "--speedup")
        prompts = list(QUICK)
        for name, model in (("original", draft), ("distilled", distilled)):
            served[name] = speedup(model, target, prompts, args.speedup_new_tokens, args.port, args.dtype)
        for prompt in prompts:
            before, after = served["original"][prompt.name], served["distilled"][prompt.name]
            print(f"{prompt.name}: speed-up {before['speedup']:.2f}x -> {after['speedup']:.2f}x "
                  f"(acceptance {before['acceptance']} -> {after['acceptance']})")
    document = {"draft": draft, "target": target, "args": vars(args), "runs": runs, "alpha": aligned, "speedup": served,
                "wall_seconds": round(time.perf_counter() - started, 1), "threads": os.cpu_count()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distill.json").write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    lines = [f"{loss}: {json.dumps({'before': r['before'], 'after': r['after'], 'steps': r['steps'], 'estimate': r['estimate']})}"
             for loss, r in runs.items()]
    (out / "distill.txt").write_text("\n".join(lines + [json.dumps(aligned), json.dumps(served)]) + "\n")
    print(f"wrote {out / 'distill.json'}, {out / 'distill.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
