"""Orchestration overhead per round: wall time per round minus the model's compute, on tiny models.

Usage:
  python bench/overhead.py [--requests 20] [--max-new-tokens 64] [--gammas 4,0]

Builds a tiny random pair (specdec.tiny) and runs the draft, target and coordinator servers as
separate processes on loopback (real gRPC, the in-process session store), as in production.
One streaming greedy session at a time; each streamed chunk is one round, so a round's wall
time is the gap between two chunks as the client sees them. The model work of the round is
measured inside the draft and target processes (this script starts them with their batch
tasks and model forwards timed on the system-wide monotonic clock): every batch task the
model workers run (forward, acceptance, drafting draws), and the model forwards alone.
Orchestration = wall − model work: the coordinator, the session store, gRPC on loopback, the
batch scheduler and the hops between threads. Two bare unary gRPC calls (GetModelInfo on
draft and target) are timed as the floor. Prints a table; writes JSON and a PNG under
bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from draft_service import server as draft_server  # noqa: E402
from specdec import tiny  # noqa: E402
from specdec.cli import wait_healthy  # noqa: E402
from specdec.config import DraftConfig, TargetConfig  # noqa: E402
from specdec.v1 import (  # noqa: E402
    common_pb2, coordinator_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc,
)
from target_service import server as target_server  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Intervals:
    """(start, end) intervals on the monotonic clock (time.perf_counter is CLOCK_MONOTONIC on
    Linux, the same in every process) recorded by wrapped functions (any thread)."""

    def __init__(self, spans: list[tuple[float, float]] | None = None) -> None:
        self.spans: list[tuple[float, float]] = [tuple(s) for s in spans or []]
        self.lock = threading.Lock()

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.spans.append((t0, time.perf_counter()))
        return timed

    def within(self, start: float, end: float) -> float:
        """Seconds of recorded spans inside [start, end]."""
        with self.lock:
            spans = sorted(self.spans)
        total = 0.0
        for s, e in spans[max(0, bisect_left(spans, (start, start)) - 1):]:
            if s > end:
                break
            total += max(0.0, min(e, end) - max(s, start))
        return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def serve(args) -> int:
    """Child process: one model service with its batch tasks and forwards timed; on stdin EOF,
    write the spans to --spans and stop."""
    start, config = ((draft_server.start, DraftConfig) if args.serve == "draft"
                     else (target_server.start, TargetConfig))
    server, _, servicer = start(config(model=args.model, dtype=args.dtype, port=args.port))
    work, forwards = Intervals(), Intervals()
    servicer.scheduler.run_batch = work.wrap(servicer.scheduler.run_batch)
    runner = servicer.proposer.runner if args.serve == "draft" else servicer.verifier.runner
    runner.model.forward = forwards.wrap(runner.model.forward)
    sys.stdin.read()
    Path(args.spans).write_text(json.dumps({"work": work.spans, "forwards": forwards.spans}))
    server.stop(None).wait()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", default="4,0")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="intra-op threads of the model services (OMP_NUM_THREADS; 0 = torch's default)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--serve", choices=("draft", "target"), help=argparse.SUPPRESS)  # child process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spans", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    root = Path(tempfile.mkdtemp(prefix="specdec-overhead-"))
    models = dict(zip(("draft", "target"), tiny.build_pair(root)))
    print(f"tiny random pair under {root} ({args.dtype})", flush=True)
    ports = {name: free_port() for name in ("draft", "target", "coordinator")}
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}))
    children = {name: subprocess.Popen(
        [sys.executable, __file__, "--serve", name, "--model", str(models[name]), "--dtype", args.dtype,
         "--port", str(ports[name]), "--spans", str(root / f"{name}.json")], stdin=subprocess.PIPE, env=env)
        for name in ("draft", "target")}
    for name in ("draft", "target"):
        wait_healthy(f"127.0.0.1:{ports[name]}", 300, list(children.values()))
    children["coordinator"] = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "coordinator", "--draft", f"127.0.0.1:{ports['draft']}",
         "--target", f"127.0.0.1:{ports['target']}", "--port", str(ports["coordinator"])],
        stdin=subprocess.DEVNULL)
    wait_healthy(f"127.0.0.1:{ports['coordinator']}", 300, list(children.values()))
    stamps: dict[int, list[list[float]]] = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports['coordinator']}") as channel, \
                grpc.insecure_channel(f"127.0.0.1:{ports['draft']}") as dch, \
                grpc.insecure_channel(f"127.0.0.1:{ports['target']}") as tch:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            bare = bare_calls(draft_pb2_grpc.DraftServiceStub(dch), target_pb2_grpc.TargetServiceStub(tch))
            for gamma in [int(g) for g in args.gammas.split(",")]:
                chunk_times(stub, gamma, 4, 16)  # warm-up
                stamps[gamma] = chunk_times(stub, gamma, args.requests, args.max_new_tokens)
    finally:
        children.pop("coordinator").terminate()
        for child in children.values():
            child.stdin.close()
        for child in children.values():
            child.wait(60)
    work, forwards = Intervals(), Intervals()
    for name in ("draft", "target"):
        spans = json.loads((root / f"{name}.json").read_text())
        work.spans += [tuple(s) for s in spans["work"]]
        forwards.spans += [tuple(s) for s in spans["forwards"]]
    results = {"bare_two_calls_ms": bare}
    for gamma, per_request in stamps.items():
        results[f"gamma_{gamma}"] = rounds(gamma, per_request, work, forwards)

    print(f"\nper-round orchestration on loopback (tiny pair, {args.dtype}, one process per service, torch threads "
          f"{args.torch_threads or 'default'}); "
          f"two bare unary gRPC calls: p50 {bare['p50']:.3f} ms, p99 {bare['p99']:.3f} ms")
    print(f"{'γ':>3} {'rounds':>7} {'wall p50':>9} {'model p50':>10} {'orch p50':>9} {'orch p99':>9} "
          f"{'orch-fwd p50':>13}   (ms per round)")
    for key, r in results.items():
        if not key.startswith("gamma_"):
            continue
        print(f"{r['gamma']:>3} {r['rounds']:>7} {r['wall_p50']:>9.3f} {r['work_p50']:>10.3f} "
              f"{r['orchestration_p50']:>9.3f} {r['orchestration_p99']:>9.3f} {r['beyond_forward_p50']:>13.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(
        {"dtype": args.dtype, "torch_threads": args.torch_threads, **{k: {kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict)
                                 else v for k, v in results.items()}}, indent=2))
    plot(out / "overhead.png", results)
    print(f"wrote {out / 'overhead.json'}")
    return 0


def bare_calls(draft, target, n: int = 300) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        draft.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
        target.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        times.append(1000 * (time.perf_counter() - t0))
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99)}


def chunk_times(stub, gamma: int, requests: int, max_new: int) -> list[list[float]]:
    """Per request, when each streamed chunk (one round) arrived."""
    out = []
    for i in range(requests):
        request = coordinator_pb2.GenerateRequest(
            prompt=f"def f{i}(x):", max_new_tokens=max_new, num_speculative_tokens=gamma, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0))
        out.append([time.perf_counter() for chunk in stub.Generate(request, timeout=600) if chunk.token_ids])
    return out


def rounds(gamma: int, per_request: list[list[float]], work: Intervals, forwards: Intervals) -> dict:
    """Per round (each chunk after a request's first): wall, model work, orchestration (ms)."""
    wall, model, orchestration, beyond_forward = [], [], [], []
    for stamps in per_request:
        for start, end in zip(stamps, stamps[1:]):
            w, m, f = end - start, work.within(start, end), forwards.within(start, end)
            wall.append(1000 * w)
            model.append(1000 * m)
            orchestration.append(1000 * (w - m))
            beyond_forward.append(1000 * (w - f))
    return {"gamma": gamma, "rounds": len(wall), "wall_p50": percentile(wall, 0.5),
            "work_p50": percentile(model, 0.5), "orchestration_p50": percentile(orchestration, 0.5),
            "orchestration_p99": percentile(orchestration, 0.99),
            "beyond_forward_p50": percentile(beyond_forward, 0.5), "samples": orchestration}


def plot(path: Path, results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, r in results.items():
        if key.startswith("gamma_"):
            ax.hist(r["samples"], bins=60, alpha=0.6, label=f"γ={r['gamma']} (p50 {r['orchestration_p50']:.2f} ms)")
    ax.axvline(results["bare_two_calls_ms"]["p50"], color="grey", linestyle="--", label="two bare gRPC calls")
    ax.set_xlabel("orchestration per round (ms)")
    ax.set_ylabel("rounds")
    ax.legend()
    ax.set_title("specdec per-round overhead (tiny models, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
