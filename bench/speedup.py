"""Speculative vs target-only decoding: tokens per second by γ.

Usage:
  python bench/speedup.py                       # the fetched real pair, started here
  python bench/speedup.py --draft-model D --target-model T [--dtype float32]
  python bench/speedup.py --address 127.0.0.1:50051   # an already running coordinator

Greedy decoding of a few code prompts at each γ (γ = 0 is the target alone through the
same path). Prints a table, writes JSON and a PNG plot under bench/results/. Speed-ups are
ratios measured in one run, so the machine's noise cancels out as far as it can.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.cli import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "# Python: read a CSV file and print the sum of the second column\nimport csv\n",
    "class Stack:\n    \"\"\"A simple stack.\"\"\"\n",
]


def start_services(args) -> tuple[str, subprocess.Popen | None]:
    if args.address:
        return args.address, None
    command = [sys.executable, "-m", "specdec.cli", "up", "--port", str(args.port), "--dtype", args.dtype]
    if args.draft_model:
        command += ["--draft-model", args.draft_model, "--target-model", args.target_model]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    address = f"127.0.0.1:{args.port}"
    wait_healthy(address, 900, [proc])
    return address, proc


def run(stub, prompt: str, gamma: int, max_new_tokens: int) -> dict:
    request = coordinator_pb2.CompleteRequest(request=coordinator_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=gamma, ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0)))
    start = time.perf_counter()
    response = stub.Complete(request, timeout=1800)
    seconds = time.perf_counter() - start
    s = response.stats
    return {"gamma": gamma, "seconds": seconds, "tokens": s.generated_tokens, "rounds": s.rounds,
            "acceptance_rate": s.acceptance_rate, "tokens_per_round": s.tokens_per_round,
            "draft_seconds": s.draft_seconds, "target_seconds": s.target_seconds,
            "coordinator_seconds": s.coordinator_seconds, "token_ids": list(response.token_ids)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--port", type=int, default=50071)
    parser.add_argument("--gammas", default="0,1,2,4,6")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    address, proc = start_services(args)
    rows: list[dict] = []
    try:
        with grpc.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            run(stub, PROMPTS[0], gammas[-1], 8)  # warm-up
            for prompt in PROMPTS:
                for gamma in gammas:
                    row = run(stub, prompt, gamma, args.max_new_tokens)
                    row["prompt"] = prompt
                    rows.append(row)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    summary = []
    for gamma in gammas:
        mine = [r for r in rows if r["gamma"] == gamma]
        tokens = sum(r["tokens"] for r in mine)
        seconds = sum(r["seconds"] for r in mine)
        summary.append({"gamma": gamma, "tokens_per_second": tokens / seconds,
                        "acceptance_rate": sum(r["acceptance_rate"] for r in mine) / len(mine),
                        "tokens_per_round": tokens / sum(r["rounds"] for r in mine),
                        "draft_share": sum(r["draft_seconds"] for r in mine) / seconds,
                        "target_share": sum(r["target_seconds"] for r in mine) / seconds})
    base = summary[0]["tokens_per_second"] if gammas[0] == 0 else None
    for r in rows:  # how far each output agrees with the first γ's (bf16/fp16 may drift on near ties)
        ref = next(b for b in rows if b["gamma"] == gammas[0] and b["prompt"] == r["prompt"])["token_ids"]
        r["common_prefix"] = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b),
                                  min(len(r["token_ids"]), len(ref)))
    identical = all(r["token_ids"] == next(b for b in rows if b["gamma"] == gammas[0] and
                                           b["prompt"] == r["prompt"])["token_ids"] for r in rows)
    print(f"{'γ':>3} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/round':>9} {'draft%':>7} {'target%':>8}")
    for row in summary:
        speedup = row["tokens_per_second"] / base if base else float("nan")
        row["speedup"] = speedup
        print(f"{row['gamma']:>3} {row['tokens_per_second']:>8.2f} {speedup:>8.2f} {row['acceptance_rate']:>7.3f}"
              f" {row['tokens_per_round']:>9.2f} {100 * row['draft_share']:>6.1f}% {100 * row['target_share']:>7.1f}%")
    print(f"greedy output identical across γ: {identical} (common prefix with γ={gammas[0]}: "
          f"{[r['common_prefix'] for r in rows]})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"address": address, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
              "summary": summary, "identical_across_gamma": identical,
              "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]}
    (out / "speedup.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["gamma"] for r in summary], [r["speedup"] for r in summary], marker="o")
        ax.axhline(1.0, color="grey", linestyle="--")
        ax.set_xlabel("γ (draft tokens per round)")
        ax.set_ylabel("speed-up over target-only")
        ax.set_title("specdec greedy speed-up")
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
    print(f"wrote {out / 'speedup.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
