"""Orchestration overhead per round: wall time per round minus the model's compute, on tiny models.

Usage:
  python bench/overhead.py [--requests 20] [--max-new-tokens 64] [--gammas 4,0]
                           [--store memory|redis://...] [--overlap on|off|on,off]
                           [--transport stream|unary|stream,unary]

Builds a tiny random pair (specdec.tiny) and runs the draft, target and coordinator servers as
separate processes on loopback (real gRPC; the in-process session store unless --store names a
Redis), as in production. --overlap off runs the coordinator with the session-store write of a
round awaited before the next round starts (the engine's `overlap_store` off), to measure what
the overlap saves; on,off runs both, one coordinator process after the other. --transport
picks how the coordinator sends Propose and Verify (its --rpc-transport): on one long-lived call
stream per service, or as unary calls; stream,unary (the default) runs both the same way.
One streaming greedy session at a time; each streamed chunk is one round, so a round's wall
time is the gap between two chunks as the client sees them. The model work of the round is
measured inside the draft and target processes (this script starts them with their batch
tasks and model forwards timed on the system-wide monotonic clock): every batch task the
model workers run (forward, acceptance, drafting draws), and the model forwards alone.
Orchestration = wall − model work: the coordinator, the session store, gRPC on loopback, the
batch scheduler and the hops between threads. It is split by spans timed in every process:
`service` = the Propose/Verify calls in the services beyond their model work (validation, the
batch scheduler, the hops to the model thread and back; timed around the servicers' `propose` /
`verify`, which unary and streamed calls share); `grpc` = the coordinator's calls beyond that
(transport, (de)serialisation, interceptors, a streamed call's dispatch, both event loops);
`store` = the coordinator's session-store writes; `rest` = what no call or write covers (the
engine's own Python, streaming the chunk to the client). Two bare unary gRPC calls
(GetModelInfo on draft and target) are timed as the floor. A second table gives each process's
CPU time per round (coordinator, client, draft, target; read from /proc at each stream's ends),
which says where the time goes when the processes share a few cores: there a round's wall time
is close to the sum of the CPU its processes spend, wherever it is spent. A third table (--floor
on, the default) is the transport floor, bench/transport_floor.py: the same round's messages over
the same call streams with handlers that answer at once, the part of the overhead that is gRPC's
and the event loops' alone. Prints the tables; writes JSON and a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench import transport_floor  # noqa: E402
from bench.processes import cpu_columns, cpu_of, cpu_spent, free_port  # noqa: E402
from specdec import tiny  # noqa: E402
from specdec.config import DraftConfig, TargetConfig  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import (  # noqa: E402
    common_pb2, coordinator_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc,
)
from target_service import server as target_server  # noqa: E402


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

    def wrap_async(self, fn):
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.spans.append((t0, time.perf_counter()))
        return timed

    def merged(self, *others: "Intervals") -> "Intervals":
        """The union of these spans and others' (overlaps counted once)."""
        spans = sorted([*self.spans, *(s for o in others for s in o.spans)])
        out: list[tuple[float, float]] = []
        for s, e in spans:
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return Intervals(out)

    def within(self, start: float, end: float) -> float:
        """Seconds of recorded spans inside [start, end]."""
        if getattr(self, "_sorted_n", -1) != len(self.spans):
            with self.lock:
                self._sorted, self._sorted_n = sorted(self.spans), len(self.spans)
        spans = self._sorted
        # spans start in order; one that starts before `start` may still reach into it
        total = 0.0
        for s, e in spans[max(0, bisect_left(spans, (start, start)) - 64):]:
            if s > end:
                break
            total += max(0.0, min(e, end) - max(s, start))
        return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def serve(args) -> int:
    """Child process: one model service with its handlers, batch tasks and forwards timed; on
    stdin EOF, write the spans to --spans and stop."""
    if args.serve == "coordinator":
        return asyncio.run(serve_coordinator(args))
    from draft_service.servicer import DraftServicer
    from target_service.servicer import TargetServicer

    work, forwards, handlers = Intervals(), Intervals(), Intervals()
    if args.serve == "draft":  # before the server binds its handlers
        start, config = draft_server.start, DraftConfig
        DraftServicer.propose = handlers.wrap_async(DraftServicer.propose)
    else:
        start, config = target_server.start, TargetConfig
        TargetServicer.verify = handlers.wrap_async(TargetServicer.verify)
    server, _, servicer = start(config(model=args.model, dtype=args.dtype, port=args.port))
    servicer.scheduler.run_batch = work.wrap(servicer.scheduler.run_batch)
    runner = servicer.proposer.runner if args.serve == "draft" else servicer.verifier.runner
    runner.model.forward = forwards.wrap(runner.model.forward)
    sys.stdin.read()
    Path(args.spans).write_text(json.dumps({"work": work.spans, "forwards": forwards.spans,
                                            "handlers": handlers.spans}))
    server.stop(None).wait()
    return 0


async def serve_coordinator(args) -> int:
    """Child process: the coordinator with its Propose/Verify calls and store writes timed."""
    from coordinator import server as coordinator_server
    from coordinator.clients import DraftClient, TargetClient
    from coordinator.engine import Engine
    from specdec.config import CoordinatorConfig

    calls, saves = Intervals(), Intervals()
    DraftClient.propose = calls.wrap_async(DraftClient.propose)
    TargetClient.verify = calls.wrap_async(TargetClient.verify)
    Engine.overlap_store = args.overlap == "on"
    running = await coordinator_server.start(CoordinatorConfig(
        draft=args.draft, target=args.target, port=args.port, session_store=args.store,
        rpc_transport=args.transport))
    store = running.engine.store
    store.save = saves.wrap_async(store.save)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    Path(args.spans).write_text(json.dumps({"calls": calls.spans, "saves": saves.spans}))
    await running.stop(None)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gammas", default="4,0")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="intra-op threads of the model services (OMP_NUM_THREADS; 0 = torch's default)")
    parser.add_argument("--store", default="memory",
                        help="the coordinator's session store: memory or a redis:// URL")
    parser.add_argument("--overlap", default="on",
                        help="overlap each round's store write with the next round's first call: "
                             "on, off, or on,off (both, one coordinator after the other)")
    parser.add_argument("--transport", default="stream,unary",
                        help="the coordinator's --rpc-transport: stream, unary, or stream,unary (both, "
                             "one coordinator after the other)")
    parser.add_argument("--floor", choices=("on", "off"), default="on",
                        help="also measure the transport floor (bench/transport_floor.py: the round's "
                             "messages with no work behind them)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--serve", choices=("draft", "target", "coordinator"), help=argparse.SUPPRESS)  # child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spans", help=argparse.SUPPRESS)
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    overlaps, transports = args.overlap.split(","), args.transport.split(",")
    if not set(overlaps) <= {"on", "off"}:
        parser.error(f"--overlap: on, off or on,off, not {args.overlap!r}")
    if not set(transports) <= {"stream", "unary"}:
        parser.error(f"--transport: stream, unary or stream,unary, not {args.transport!r}")
    root = Path(tempfile.mkdtemp(prefix="specdec-overhead-"))
    models = dict(zip(("draft", "target"), tiny.build_pair(root)))
    print(f"tiny random pair under {root} ({args.dtype}, store {args.store})", flush=True)
    ports = {name: free_port() for name in ("draft", "target")}
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}))
    children = {name: subprocess.Popen(
        [sys.executable, __file__, "--serve", name, "--model", str(models[name]), "--dtype", args.dtype,
         "--port", str(ports[name]), "--spans", str(root / f"{name}.json")], stdin=subprocess.PIPE, env=env)
        for name in ("draft", "target")}
    stamps: dict[tuple[str, str, int], tuple] = {}  # (per request chunk times, CPU per process)
    try:
        for name in ("draft", "target"):
            wait_healthy(f"127.0.0.1:{ports[name]}", 300, list(children.values()))
        with grpc.insecure_channel(f"127.0.0.1:{ports['draft']}") as dch, \
                grpc.insecure_channel(f"127.0.0.1:{ports['target']}") as tch:
            bare = bare_calls(draft_pb2_grpc.DraftServiceStub(dch), target_pb2_grpc.TargetServiceStub(tch))
        for overlap in overlaps:
            for transport in transports:
                stamps.update(run_coordinator(args, overlap, transport, ports, root, children))
    finally:
        for child in children.values():
            child.stdin.close()
        for child in children.values():
            child.wait(60)
    spans = {name: json.loads((root / f"{name}.json").read_text()) for name in ("draft", "target")}
    work, forwards, handlers = (Intervals([tuple(s) for name in spans for s in spans[name][kind]])
                                for kind in ("work", "forwards", "handlers"))
    results: dict = {"bare_two_calls_ms": bare}
    for (overlap, transport, gamma), per_request in stamps.items():
        coordinator = json.loads((root / f"coordinator-{overlap}-{transport}.json").read_text())
        calls, saves = (Intervals([tuple(s) for s in coordinator[kind]]) for kind in ("calls", "saves"))
        per_request, cpu = per_request
        n = max(1, sum(len(stamps) - 1 for stamps in per_request))
        results[f"gamma_{gamma}_overlap_{overlap}_{transport}"] = {
            "overlap": overlap, "transport": transport,
            **rounds(gamma, per_request, work, forwards, handlers, calls, saves),
            **{f"cpu_{name}_ms": None if s is None else 1000 * s / n for name, s in cpu.items()}}
    if args.floor == "on":
        results["transport_floor"] = transport_floor.measure([int(g) for g in args.gammas.split(",")])
    report(args, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(
        {"dtype": args.dtype, "torch_threads": args.torch_threads, "store": args.store,
         **{k: {kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict) else v
            for k, v in results.items()}}, indent=2))
    plot(out / "overhead.png", results)
    print(f"wrote {out / 'overhead.json'}")
    return 0


def run_coordinator(args, overlap: str, transport: str, ports: dict[str, int], root: Path,
                    services: dict[str, subprocess.Popen]) -> dict[tuple[str, str, int], tuple]:
    """Start a coordinator (overlap on or off, stream or unary transport), time every γ's
    streams through it, stop it."""
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "coordinator", "--draft", f"127.0.0.1:{ports['draft']}",
         "--target", f"127.0.0.1:{ports['target']}", "--port", str(port), "--store", args.store,
         "--overlap", overlap, "--transport", transport,
         "--spans", str(root / f"coordinator-{overlap}-{transport}.json")], stdin=subprocess.PIPE)
    stamps = {}
    try:
        wait_healthy(f"127.0.0.1:{port}", 300, [child, *services.values()])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for gamma in [int(g) for g in args.gammas.split(",")]:
                pids = {"coordinator": child.pid, "client": os.getpid(),
                        **{name: service.pid for name, service in services.items()}}
                chunk_times(stub, gamma, 4, 16, pids)  # warm-up
                stamps[overlap, transport, gamma] = chunk_times(stub, gamma, args.requests, args.max_new_tokens, pids)
    finally:
        child.stdin.close()
        child.wait(60)
    return stamps


def report(args, results: dict) -> None:
    bare = results["bare_two_calls_ms"]
    print(f"\nper-round orchestration on loopback (tiny pair, {args.dtype}, one process per service, torch threads "
          f"{args.torch_threads or 'default'}, store {args.store}); "
          f"two bare unary gRPC calls: p50 {bare['p50']:.3f} ms, p99 {bare['p99']:.3f} ms")
    print(f"{'γ':>3} {'overlap':>7} {'rpc':>6} {'rounds':>7} {'wall p50':>9} {'model p50':>10} {'orch p50':>9} "
          f"{'orch p99':>9} {'orch-fwd':>9} | {'service':>8} {'grpc':>8} {'store':>8} {'rest':>8}"
          "   (ms per round; after | the p50 of each part of orch)")
    for key, r in results.items():
        if not key.startswith("gamma_"):
            continue
        print(f"{r['gamma']:>3} {r['overlap']:>7} {r['transport']:>6} {r['rounds']:>7} {r['wall_p50']:>9.3f} "
              f"{r['work_p50']:>10.3f} "
              f"{r['orchestration_p50']:>9.3f} {r['orchestration_p99']:>9.3f} {r['beyond_forward_p50']:>9.3f} | "
              f"{r['service_p50']:>8.3f} {r['grpc_p50']:>8.3f} {r['store_p50']:>8.3f} {r['rest_p50']:>8.3f}")
    print("\nCPU per round, by process (ms, mean over the rounds; processes sharing the cores delay each other "
          "even off the critical path; draft and target include their model work)")
    print(f"{'γ':>3} {'overlap':>7} {'rpc':>6} | {'coordinator':>11} {'client':>8} {'draft':>8} {'target':>8}")
    for key, r in results.items():
        if key.startswith("gamma_"):
            print(f"{r['gamma']:>3} {r['overlap']:>7} {r['transport']:>6} | {cpu_columns(r)}")
    if "transport_floor" in results:
        transport_floor.report(results["transport_floor"])


def bare_calls(draft, target, n: int = 300) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        draft.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
        target.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        times.append(1000 * (time.perf_counter() - t0))
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99)}


def chunk_times(stub, gamma: int, requests: int, max_new: int, pids: dict[str, int]
                ) -> tuple[list[list[float]], dict[str, float | None]]:
    """Per request, when each streamed chunk (one round) arrived; and the CPU seconds each
    process in `pids` spent from each request's first chunk to the end of its stream, summed
    (None where /proc cannot tell)."""
    out, spent = [], {name: 0.0 for name in pids}
    for i in range(requests):
        request = coordinator_pb2.GenerateRequest(
            prompt=f"def f{i}(x):", max_new_tokens=max_new, num_speculative_tokens=gamma, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0))
        stamps, first = [], None
        for chunk in stub.Generate(request, timeout=600):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                first = first or cpu_of(pids)  # from the first round's end: the rounds timed below
        out.append(stamps)
        if first is not None:
            for name, seconds in cpu_spent(first, cpu_of(pids)).items():
                spent[name] = None if seconds is None or spent[name] is None else spent[name] + seconds
    return out, spent


def rounds(gamma: int, per_request: list[list[float]], work: Intervals, forwards: Intervals,
           handlers: Intervals, calls: Intervals, saves: Intervals) -> dict:
    """Per round (each chunk after a request's first): wall, model work, orchestration and its
    parts (ms); see the module docstring."""
    covered = calls.merged(saves)
    parts: dict[str, list[float]] = {k: [] for k in ("wall", "work", "orchestration", "beyond_forward",
                                                     "service", "grpc", "store", "rest")}
    for stamps in per_request:
        for start, end in zip(stamps, stamps[1:]):
            w, m, f = end - start, work.within(start, end), forwards.within(start, end)
            h, c = handlers.within(start, end), calls.within(start, end)
            for key, value in (("wall", w), ("work", m), ("orchestration", w - m), ("beyond_forward", w - f),
                               ("service", h - m), ("grpc", c - h), ("store", saves.within(start, end)),
                               ("rest", w - covered.within(start, end))):
                parts[key].append(1000 * value)
    out = {"gamma": gamma, "rounds": len(parts["wall"]), "samples": parts["orchestration"],
           "orchestration_p99": percentile(parts["orchestration"], 0.99)}
    out.update({f"{key}_p50": percentile(values, 0.5) for key, values in parts.items()})
    return out


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
            ax.hist(r["samples"], bins=60, alpha=0.6,
                    label=f"γ={r['gamma']} overlap {r['overlap']} {r['transport']} "
                          f"(p50 {r['orchestration_p50']:.2f} ms)")
    ax.axvline(results["bare_two_calls_ms"]["p50"], color="grey", linestyle="--", label="two bare gRPC calls")
    for gamma, floor in results.get("transport_floor", {}).items():
        ax.axvline(floor["p50"], color="black", linestyle=":" if gamma else "-.",
                   label=f"transport floor γ={gamma} (p50 {floor['p50']:.2f} ms)")
    ax.set_xlabel("orchestration per round (ms)")
    ax.set_ylabel("rounds")
    ax.legend()
    ax.set_title("specdec per-round overhead (tiny models, loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
