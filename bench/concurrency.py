"""Concurrent sessions: aggregate tokens/s and per-token latency at 1, 4, 16, 32 sessions.

Usage:
  python bench/concurrency.py                              # the fetched real pair
  python bench/concurrency.py --draft-model D --target-model T [--dtype float32]
  python bench/concurrency.py --max-batch-size 1           # the same, services never batch

Without a fetched pair and without --draft-model/--target-model it builds a tiny random pair
(specdec_cli.tiny; its text is noise and its draft is unrelated to its target) and says so.
The three services run as `specdec up` subprocesses (batching flags through the environment);
each level starts C concurrent streaming greedy sessions of --max-new-tokens tokens, once per
entry of --gammas (default auto,4,0): "auto" leaves num_speculative_tokens and proposer unset, so
the coordinator's default policy (proposer auto, adaptive γ) applies; a number fixes γ (0 = no
speculation). The summary compares auto with γ=0 at every level. Per-token latency is each
streamed chunk's gap divided among its tokens. Before the services start, the target model is loaded here to measure the
cost of ONE batched forward of B sessions × 1 (and × 5) tokens relative to one 1-token step:
B / that ratio is the ceiling of what batching can give. Prints tables, writes JSON and a PNG
under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

LEVELS = (1, 4, 16, 32)
PROMPTS = [
    "def fibonacci(n):",
    "# Python: read a CSV file and print the sum of the second column\nimport csv\n",
    "class Stack:\n    \"\"\"A simple stack.\"\"\"\n",
    "for i in range(10):\n",
]


def pick_models(args) -> tuple[str, str, str]:
    """(draft, target, what they are)."""
    if args.draft_model and args.target_model:
        return args.draft_model, args.target_model, "given"
    from specdec_cli.model_pair import FetchError, default_pair

    try:
        pair = default_pair()
        return str(pair["draft"]), str(pair["target"]), "the fetched real pair"
    except FetchError:
        from specdec_cli import tiny

        root = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
        draft, target = tiny.build_pair(root, width=args.tiny_width, layers=args.tiny_layers, context=2048)
        kind = "an unrelated 1-layer draft"
        if args.tiny_draft == "self":
            draft, kind = target, "the target as its own draft"
        print(f"no real pair fetched: using a TINY RANDOM pair (width {args.tiny_width}, target "
              f"{args.tiny_layers} layers, {kind}) under {root}", flush=True)
        return (str(draft), str(target),
                f"tiny random pair: width {args.tiny_width}, {args.tiny_layers} layers, {kind}")


# ---- the ceiling: one batched forward against one 1-token step ----------------------------------

def forward_costs(target: str, dtype: str, history: int, repeats: int) -> list[dict]:
    from specdec.runtime.kv_cache import SessionCaches
    from specdec.runtime.loader import load_model
    from specdec.runtime.torch.engine import TorchEngine
    from specdec.runtime.session_kv import Row

    engine = TorchEngine(load_model(target, dtype), SessionCaches(1024, 1 << 40), 16)
    rng = random.Random(0)
    entries = []
    for b in range(max(LEVELS)):
        entry = engine.new_entry()
        engine.caches.put(f"c{b}", entry)
        engine.forward(f"c{b}", entry, [rng.randrange(1, 200) for _ in range(history)], 1)
        entries.append(entry)

    configs = [(batch, tokens) for tokens in (1, 5) for batch in LEVELS]
    rows = {(batch, tokens): [Row(f"c{b}", entries[b], [rng.randrange(1, 200) for _ in range(tokens)], tokens)
                              for b in range(batch)] for batch, tokens in configs}
    best = {config: float("inf") for config in configs}
    for i in range(repeats + 2):  # interleaved, so a busy moment on a shared machine hits all alike
        for config in configs:
            t0 = time.perf_counter()
            engine.forward_batch(rows[config])
            seconds = time.perf_counter() - t0
            for row in rows[config]:
                row.entry.crop(history)
            if i >= 2:  # the first two rounds warm up
                best[config] = min(best[config], seconds)  # the fastest run is the cost
    base = best[(1, 1)]
    out = [{"batch": batch, "tokens_per_row": tokens, "seconds": best[(batch, tokens)],
            "relative": best[(batch, tokens)] / base, "ceiling_speedup": batch * base / best[(batch, tokens)]}
           for batch, tokens in configs]
    del engine
    return out


# ---- the load ---------------------------------------------------------------------------------

def start_services(args, draft: str, target: str) -> subprocess.Popen:
    env = dict(os.environ)
    if args.torch_threads:
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    for service in ("DRAFT", "TARGET"):
        env[f"SPECDEC_{service}_MAX_BATCH_SIZE"] = str(args.max_batch_size)
        env[f"SPECDEC_{service}_BATCH_WAIT_MS"] = str(args.batch_wait_ms)
    command = [sys.executable, "-m", "specdec_cli", "up", "--port", str(args.port), "--dtype", args.dtype,
               "--draft-model", draft, "--target-model", target, "--http-port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
    wait_healthy(f"127.0.0.1:{args.port}", 900, [proc])
    return proc


AUTO = "auto"  # --gammas entry: the coordinator's default policy (nothing set in the request)


def parse_gammas(text: str) -> list[int | str]:
    """"auto,4,0" -> ["auto", 4, 0]."""
    return [AUTO if g.strip() == AUTO else int(g) for g in text.split(",")]


def generate_request(prompt: str, gamma: int | str, max_new: int) -> coordinator_pb2.GenerateRequest:
    """A greedy request; γ "auto" leaves num_speculative_tokens and proposer unset (the default)."""
    request = coordinator_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new, ignore_eos=True,
                                              sampling=common_pb2.SamplingParams(temperature=0.0))
    if gamma != AUTO:
        request.num_speculative_tokens = gamma
    return request


def session(stub, prompt: str, gamma: int | str, max_new: int, out: list, lock: threading.Lock) -> None:
    request = generate_request(prompt, gamma, max_new)
    gaps: list[float] = []
    last = time.perf_counter()
    tokens, stats = 0, None
    for chunk in stub.Generate(request, timeout=3600):
        now = time.perf_counter()
        if chunk.token_ids:
            gaps.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
            tokens += len(chunk.token_ids)
        last = now
        if chunk.finish_reason:
            stats = chunk.stats
    with lock:
        out.append({"tokens": tokens, "gaps": gaps, "rounds": stats.rounds,
                    "acceptance_rate": stats.acceptance_rate})


def cpu_seconds(proc: subprocess.Popen) -> dict[str, float]:
    """CPU seconds so far of each service process (by its `serve` role) and of this client."""
    import psutil

    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
            role = cmd[cmd.index("serve") + 1] if "serve" in cmd else None
            if role:
                out[role] = sum(child.cpu_times()[:2])
        except (psutil.Error, IndexError):
            pass
    return out


def level(address: str, sessions: int, gamma: int | str, max_new: int, proc: subprocess.Popen) -> dict:
    results: list[dict] = []
    cpu_before = cpu_seconds(proc)
    lock = threading.Lock()
    channels = [grpc.insecure_channel(address) for _ in range(min(sessions, 8))]
    stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in channels]
    threads = [threading.Thread(target=session, args=(stubs[i % len(stubs)], PROMPTS[i % len(PROMPTS)], gamma,
                                                      max_new, results, lock)) for i in range(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu_after = cpu_seconds(proc)
    for c in channels:
        c.close()
    gaps = sorted(g for r in results for g in r["gaps"])
    tokens = sum(r["tokens"] for r in results)
    return {"sessions": sessions, "gamma": gamma, "tokens": tokens, "seconds": wall,
            "tokens_per_second": tokens / wall,
            "p50_token_ms": 1000 * gaps[len(gaps) // 2], "p99_token_ms": 1000 * gaps[int(len(gaps) * 0.99)],
            "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in results),
            "tokens_per_round": tokens / max(1, sum(r["rounds"] for r in results)),
            "cpu_ms_per_token": {k: 1000 * (cpu_after[k] - cpu_before.get(k, 0.0)) / tokens for k in cpu_after}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--port", type=int, default=50081)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gammas", default="auto,4,0",
                        help="γ per run, comma-separated: auto (the coordinator's default policy) or a number")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)))
    parser.add_argument("--max-batch-size", type=int, default=32, help="the services' --max-batch-size")
    parser.add_argument("--batch-wait-ms", type=float, default=2.0, help="the services' --batch-wait-ms")
    parser.add_argument("--history", type=int, default=128, help="tokens each session holds in the ceiling test")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiny-width", type=int, default=256)
    parser.add_argument("--tiny-layers", type=int, default=4)
    parser.add_argument("--tiny-draft", choices=("unrelated", "self"), default="unrelated",
                        help="tiny pair only: an unrelated random draft (acceptance near 0) or the target "
                             "itself (every draft accepted)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="intra-op threads of each model service and of the ceiling test (OMP_NUM_THREADS; "
                             "0 = torch's default). On a small shared machine 1 avoids threads spinning against "
                             "each other")
    parser.add_argument("--skip-ceiling", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole γ × sessions list this many times, interleaved, against the same "
                             "services, and report each level's median run (the first round finds a cold "
                             "coordinator; later ones one that has served, as in production)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    draft, target, what = pick_models(args)
    levels = [int(x) for x in args.levels.split(",")]
    gammas = parse_gammas(args.gammas)

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    ceiling = [] if args.skip_ceiling else forward_costs(target, args.dtype, args.history, args.repeats)
    if ceiling:
        print(f"\none batched forward vs one 1-token step ({what}, {args.dtype}, {args.history}-token histories, "
              f"torch threads {args.torch_threads or 'default'})")
        print(f"{'rows':>5} {'tok/row':>8} {'ms':>8} {'x 1-token step':>15} {'ceiling speed-up':>17}")
        for row in ceiling:
            print(f"{row['batch']:>5} {row['tokens_per_row']:>8} {1000 * row['seconds']:>8.2f} "
                  f"{row['relative']:>15.2f} {row['ceiling_speedup']:>17.2f}")

    proc = start_services(args, draft, target)
    runs: list[dict] = []
    try:
        address = f"127.0.0.1:{args.port}"
        level(address, 2, gammas[0], 8, proc)  # warm-up
        for round_ in range(max(1, args.rounds)):
            for gamma in gammas:
                for sessions in levels:
                    runs.append({**level(address, sessions, gamma, args.max_new_tokens, proc), "round": round_})
                    print(f"  {label(gamma)} sessions={sessions}: {runs[-1]['tokens_per_second']:.1f} tok/s",
                          flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    rows = median_runs(runs)

    threads = args.torch_threads or "default"
    print(f"\nconcurrent sessions ({what}, {args.dtype}, {args.max_new_tokens} new tokens each, "
          f"max batch {args.max_batch_size}, wait {args.batch_wait_ms} ms, torch threads {threads})")
    if args.rounds > 1:
        print(f"(each row: the median of {args.rounds} interleaved runs; runs lists every run's tok/s in order)")
    print(f"{'γ':>4} {'sessions':>9} {'tok/s':>9} {'x 1 session':>12} {'p50 ms/tok':>11} {'p99 ms/tok':>11} "
          f"{'accept':>7} {'tok/round':>10}" + ("  runs" if args.rounds > 1 else ""))
    for row in rows:
        one = next(r for r in rows if r["gamma"] == row["gamma"] and r["sessions"] == levels[0])
        row["scaling"] = row["tokens_per_second"] / one["tokens_per_second"]
        print(f"{row['gamma']:>4} {row['sessions']:>9} {row['tokens_per_second']:>9.1f} {row['scaling']:>12.2f} "
              f"{row['p50_token_ms']:>11.2f} {row['p99_token_ms']:>11.2f} {row['acceptance_rate']:>7.3f} "
              f"{row['tokens_per_round']:>10.2f}"
              + ("  " + " ".join(f"{t:.1f}" for t in row["runs"]) if args.rounds > 1 else ""))
    roles = ("coordinator", "draft", "target", "client")
    print("\nCPU ms per generated token, by process (where the time goes)")
    print(f"{'γ':>4} {'sessions':>9} " + " ".join(f"{r:>12}" for r in roles))
    for row in rows:
        cpu = row["cpu_ms_per_token"]
        print(f"{row['gamma']:>4} {row['sessions']:>9} " + " ".join(f"{cpu.get(r, float('nan')):>12.2f}" for r in roles))
    versus = auto_vs_target_only(rows)
    if versus:
        print("\nauto vs γ=0 (tokens/s ratio; the target: never below 1)")
        for row in versus:
            print(f"  {row['sessions']:>3} sessions: {row['ratio']:.3f}" + ("" if row["ratio"] >= 1 else "  SLOWER"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"models": what, "draft": draft, "target": target, "dtype": args.dtype,
              "max_new_tokens": args.max_new_tokens, "max_batch_size": args.max_batch_size,
              "batch_wait_ms": args.batch_wait_ms, "torch_threads": args.torch_threads, "levels": rows,
              "rounds": args.rounds, "runs": runs,
              "batched_forward": ceiling, "auto_vs_gamma0": versus}
    (out / "concurrency.json").write_text(json.dumps(result, indent=2))
    plot(out / "concurrency.png", rows, ceiling, gammas, what)
    print(f"wrote {out / 'concurrency.json'}")
    return 0


def median_runs(runs: list[dict]) -> list[dict]:
    """Per (γ, sessions), in first-run order: the run with the median tokens/s (the lower middle
    of an even count), with every run's tokens/s under "runs"."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["gamma"], run["sessions"]), []).append(run)
    rows = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["tokens_per_second"])
        rows.append({**ranked[(len(ranked) - 1) // 2], "runs": [r["tokens_per_second"] for r in group]})
    return rows


def auto_vs_target_only(rows: list[dict]) -> list[dict]:
    """Per level run with both: auto's tokens/s over γ=0's."""
    by = {(r["gamma"], r["sessions"]): r["tokens_per_second"] for r in rows}
    return [{"sessions": n, "ratio": by[(AUTO, n)] / by[(0, n)]}
            for (g, n) in by if g == AUTO and (0, n) in by]


def label(gamma: int | str) -> str:
    return AUTO if gamma == AUTO else f"γ={gamma}"


def plot(path: Path, rows: list[dict], ceiling: list[dict], gammas: list[int | str], what: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for gamma in gammas:
        mine = [r for r in rows if r["gamma"] == gamma]
        left.plot([r["sessions"] for r in mine], [r["tokens_per_second"] for r in mine], marker="o",
                  label=label(gamma))
        right.plot([r["sessions"] for r in mine], [r["p50_token_ms"] for r in mine], marker="o",
                   label=f"p50 {label(gamma)}")
        right.plot([r["sessions"] for r in mine], [r["p99_token_ms"] for r in mine], marker="x", linestyle="--",
                   label=f"p99 {label(gamma)}")
    if ceiling:
        one = next(r for r in rows if r["sessions"] == min(r["sessions"] for r in rows) and r["gamma"] == 0) \
            if any(r["gamma"] == 0 for r in rows) else None
        if one:
            ones = [c for c in ceiling if c["tokens_per_row"] == 1]
            left.plot([c["batch"] for c in ones], [one["tokens_per_second"] * c["ceiling_speedup"] for c in ones],
                      color="grey", linestyle=":", label="γ=0 ceiling (batched forward cost)")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent sessions")
    left.set_ylabel("aggregate tokens/s")
    left.legend()
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrent sessions")
    right.set_ylabel("ms per token (client side)")
    right.legend()
    fig.suptitle(f"specdec concurrency ({what})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
