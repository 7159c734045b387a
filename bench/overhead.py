"""Orchestration overhead per round: wall time per round minus the model's compute, on tiny models.

Usage:
  python bench/overhead.py [--requests 20] [--max-new-tokens 64] [--gammas 4,0]
                           [--store memory|redis://...] [--overlap on|off|on,off]
                           [--transport stream|unary|stream,unary] [--floor on|off]
                           [--pair random|near] [--link-delay-ms 0,0.2,0.5,1,2]
                           [--link-jitter-ms J] [--link-repeats 4]

Builds a tiny random pair (specdec_cli.tiny) and runs the draft, target and coordinator servers as
separate processes on loopback (real gRPC; the in-process session store unless --store names a
Redis), as in production. --overlap off runs the coordinator with the session-store write of a
round awaited before the next round starts (the round loop's `overlap_store` off), to measure what
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
round loop's own Python, streaming the chunk to the client). Two bare unary gRPC calls
(GetModelInfo on draft and target) are timed as the floor. A second table gives each process's
CPU time per round (coordinator, client, draft, target; read from /proc at each stream's ends),
which says where the time goes when the processes share a few cores: there a round's wall time
is close to the sum of the CPU its processes spend, wherever it is spent. A third table (--floor
on, the default) is the transport floor, bench/transport_floor.py: the same round's messages over
the same call streams with handlers that answer at once, the part of the overhead that is gRPC's
and the event loops' alone.

--link-delay-ms D1,D2,... (default 0: none of this) adds the link sweep: the same rounds at
cluster-like round trips. Each service gets a delaying TCP proxy (bench/link_proxy.py) in a
process of its own, so its threads share no GIL with anything measured; the coordinators of the
sweep reach the draft and the target through them, each direction of each connection delayed by
D ± J (uniform; a call's round trip costs 2D), and the proxies are re-used across the delays
(told "delay D J" on stdin). D = 0 is loopback without a proxy. J is --link-jitter-ms, by
default a tenth of each D. At each delay the γ > 0 rows run twice, with the coordinator's
--draft-ahead on and off (both with --tiers-share-cores no, as for tiers on separate hosts; γ > 0
requests name the draft model as their proposer, so every round is a draft-model round), and
γ = 0 once. The sweep is run --link-repeats times, the delays and the on/off order reversed
every other repeat, each cell a share of --requests per repeat: on a noisy machine the ratios
come from configurations interleaved in one run. It prints, per delay, the wall and
orchestration time per round (orchestration here = wall − the union of the model work, which
includes the link's delay), two bare unary calls through the links, the proxies' CPU per round
(they share the cores), and with drafting ahead on against off the ms per token, tokens/s and
their ratio (pooled, and the range of the per-repeat ratios) with the calls made ahead and the
rounds drafted ahead from the requests' GenerationStats. --pair near replaces the random draft
with the target's weights slightly perturbed, a draft the target agrees with most of the time:
with the random pair the target accepts almost nothing, so drafting ahead has nothing to skip.

Prints the tables; writes JSON (the sweep under "link") and a PNG under bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import selectors
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
from specdec_cli import tiny  # noqa: E402
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
    from coordinator.sessions.clients import DraftClient, TargetClient
    from coordinator.round_loop import RoundLoop
    from specdec.config import CoordinatorConfig

    calls, saves = Intervals(), Intervals()
    DraftClient.propose = calls.wrap_async(DraftClient.propose)
    TargetClient.verify = calls.wrap_async(TargetClient.verify)
    RoundLoop.overlap_store = args.overlap == "on"
    running = await coordinator_server.start(CoordinatorConfig(
        draft=args.draft, target=args.target, port=args.port, session_store=args.store,
        rpc_transport=args.transport, draft_ahead=args.draft_ahead, tiers_share_cores=args.tiers_share_cores))
    store = running.round_loop.store
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
    parser.add_argument("--pair", choices=("random", "near"), default="random",
                        help="the tiny draft: random (its own random weights, a 1-layer model) or near "
                             "(the target's weights slightly perturbed: drafts the target mostly accepts)")
    parser.add_argument("--link-delay-ms", default="0",
                        help="one-way link delays to sweep (comma list, ms; 0 = loopback without a proxy); "
                             "the default 0 runs no sweep")
    parser.add_argument("--link-jitter-ms", type=float, default=None,
                        help="uniform jitter of each direction around the delay (ms; default: a tenth of "
                             "each delay)")
    parser.add_argument("--link-repeats", type=int, default=4,
                        help="interleaved repeats of the sweep; a cell gets --requests / this requests each")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--serve", choices=("draft", "target", "coordinator"), help=argparse.SUPPRESS)  # child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spans", help=argparse.SUPPRESS)
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--draft-ahead", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--tiers-share-cores", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    overlaps, transports = args.overlap.split(","), args.transport.split(",")
    if not set(overlaps) <= {"on", "off"}:
        parser.error(f"--overlap: on, off or on,off, not {args.overlap!r}")
    if not set(transports) <= {"stream", "unary"}:
        parser.error(f"--transport: stream, unary or stream,unary, not {args.transport!r}")
    try:
        delays = parse_delays(args.link_delay_ms)
    except ValueError as exc:
        parser.error(f"--link-delay-ms: {exc}")
    if args.link_jitter_ms is not None and args.link_jitter_ms < 0:
        parser.error("--link-jitter-ms must be >= 0")
    if args.link_repeats < 1:
        parser.error("--link-repeats must be >= 1")
    sweep = delays != [0.0]
    root = Path(tempfile.mkdtemp(prefix="specdec-overhead-"))
    models = dict(zip(("draft", "target"), tiny.build_pair(root)))
    if args.pair == "near":
        models["draft"] = near_draft(models["target"], root / "draft-near")
    print(f"tiny {args.pair} pair under {root} ({args.dtype}, store {args.store})", flush=True)
    ports = {name: free_port() for name in ("draft", "target")}
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}))
    children = {name: subprocess.Popen(
        [sys.executable, __file__, "--serve", name, "--model", str(models[name]), "--dtype", args.dtype,
         "--port", str(ports[name]), "--spans", str(root / f"{name}.json")], stdin=subprocess.PIPE, env=env)
        for name in ("draft", "target")}
    stamps: dict[tuple[str, str, int], tuple] = {}  # (per request chunk times, CPU per process)
    cells: dict = {}  # the link sweep's, see link_sweep
    try:
        for name in ("draft", "target"):
            wait_healthy(f"127.0.0.1:{ports[name]}", 300, list(children.values()))
        with grpc.insecure_channel(f"127.0.0.1:{ports['draft']}") as dch, \
                grpc.insecure_channel(f"127.0.0.1:{ports['target']}") as tch:
            bare = bare_calls(draft_pb2_grpc.DraftServiceStub(dch), target_pb2_grpc.TargetServiceStub(tch))
        for overlap in overlaps:
            for transport in transports:
                stamps.update(run_coordinator(args, overlap, transport, ports, root, children))
        if sweep:
            cells = link_sweep(args, delays, [(o, t) for o in overlaps for t in transports], ports, root,
                               children, bare)
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
    if sweep:
        results["link"] = link_results(args, delays, cells, root, work.merged(), forwards.merged(), handlers)
    if args.floor == "on":
        results["transport_floor"] = transport_floor.measure([int(g) for g in args.gammas.split(",")])
    report(args, results)
    if sweep:
        report_link(args, results["link"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(
        {"dtype": args.dtype, "torch_threads": args.torch_threads, "store": args.store, "pair": args.pair,
         **{k: {kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict) else v
            for k, v in results.items()}}, indent=2))
    plot(out / "overhead.png", results)
    print(f"wrote {out / 'overhead.json'}")
    return 0


def start_coordinator(args, tag: str, draft: str, target: str, overlap: str, transport: str, root: Path,
                      ahead: str = "auto", share_cores: str = "auto") -> tuple[subprocess.Popen, int]:
    """A coordinator process reaching the draft and the target at these addresses; it writes its
    spans to root/coordinator-{tag}.json when its stdin closes. (process, port)"""
    port = free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "coordinator", "--draft", draft, "--target", target,
         "--port", str(port), "--store", args.store, "--overlap", overlap, "--transport", transport,
         "--draft-ahead", ahead, "--tiers-share-cores", share_cores,
         "--spans", str(root / f"coordinator-{tag}.json")], stdin=subprocess.PIPE)
    return child, port


def run_coordinator(args, overlap: str, transport: str, ports: dict[str, int], root: Path,
                    services: dict[str, subprocess.Popen]) -> dict[tuple[str, str, int], tuple]:
    """Start a coordinator (overlap on or off, stream or unary transport), time every γ's
    streams through it, stop it."""
    child, port = start_coordinator(args, f"{overlap}-{transport}", f"127.0.0.1:{ports['draft']}",
                                    f"127.0.0.1:{ports['target']}", overlap, transport, root)
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
    times = bare_times(draft, target, n)
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99)}


def bare_times(draft, target, n: int) -> list[float]:
    """ms of each of n pairs of bare unary calls (GetModelInfo on the draft, then the target)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        draft.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
        target.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        times.append(1000 * (time.perf_counter() - t0))
    return times


STAT_FIELDS = ("rounds", "generated_tokens", "draft_rounds", "draft_tokens", "accepted_tokens",
               "draft_ahead_calls", "draft_ahead_rounds")


def chunk_times(stub, gamma: int, requests: int, max_new: int, pids: dict[str, int],
                proposer: int = coordinator_pb2.PROPOSER_UNSPECIFIED, tally: dict | None = None,
                ) -> tuple[list[list[float]], dict[str, float | None]]:
    """Per request, when each streamed chunk (one round) arrived; and the CPU seconds each
    process in `pids` spent from each request's first chunk to the end of its stream, summed
    (None where /proc cannot tell). A `tally` given gets the tokens of the timed rounds (every
    chunk after a request's first), their seconds, and the sums of the requests' STAT_FIELDS."""
    out, spent = [], {name: 0.0 for name in pids}
    if tally is not None:
        for key in ("tokens", "seconds", *STAT_FIELDS):
            tally.setdefault(key, 0)
    for i in range(requests):
        request = coordinator_pb2.GenerateRequest(
            prompt=f"def f{i}(x):", max_new_tokens=max_new, num_speculative_tokens=gamma, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0), proposer=proposer)
        stamps, first, tokens, stats = [], None, 0, None
        for chunk in stub.Generate(request, timeout=600):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                tokens += len(chunk.token_ids) if len(stamps) > 1 else 0
                first = first or cpu_of(pids)  # from the first round's end: the rounds timed below
            if chunk.HasField("stats"):
                stats = chunk.stats
        out.append(stamps)
        if first is not None:
            for name, seconds in cpu_spent(first, cpu_of(pids)).items():
                spent[name] = None if seconds is None or spent[name] is None else spent[name] + seconds
        if tally is not None and len(stamps) > 1:
            tally["tokens"] += tokens
            tally["seconds"] += stamps[-1] - stamps[0]
            for key in STAT_FIELDS:
                tally[key] += getattr(stats, key) if stats is not None else 0
    return out, spent


# ---- the link sweep (--link-delay-ms) ---------------------------------------------------------


def parse_delays(text: str) -> list[float]:
    """--link-delay-ms: one-way delays in ms, comma-separated, each >= 0, in the order given."""
    delays = []
    for word in text.split(","):
        delay = float(word)
        if not math.isfinite(delay) or delay < 0:
            raise ValueError(f"a delay must be a finite number >= 0, not {word!r}")
        if delay not in delays:
            delays.append(delay)
    if not delays:
        raise ValueError("no delay given")
    return delays


def jitter_of(args, delay: float) -> float:
    """The jitter (ms) of a link of this one-way delay: --link-jitter-ms, or a tenth of the delay."""
    if delay == 0:
        return 0.0
    return args.link_jitter_ms if args.link_jitter_ms is not None else delay / 10


def near_draft(target: Path, path: Path, scale: float = 0.01, seed: int = 0) -> Path:
    """A draft the target mostly agrees with (--pair near): the target's own weights, each tensor
    perturbed by Gaussian noise of `scale` times its standard deviation (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.numel() > 1:
                weight.add_(torch.randn(weight.shape, generator=generator) * scale * weight.std())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return path


class LinkProcess:
    """bench/link_proxy.py in a process of its own, in front of one service (`to`: HOST:PORT)."""

    def __init__(self, to: str, delay_ms: float, jitter_ms: float, seed: int = 0, timeout_s: float = 60.0):
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "link_proxy.py"), "--listen", "127.0.0.1:0", "--to", to,
             "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms), "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            line = self.process.stdout.readline() if selector.select(timeout_s) else ""
        words = line.split()
        if len(words) != 3 or words[0] != "listening":
            self.close()
            raise RuntimeError(f"link proxy to {to} did not start (said {line!r})")
        self.address = f"{words[1]}:{words[2]}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def set_delay(self, delay_ms: float, jitter_ms: float) -> None:
        """Applies once the proxy reads the line (it does not answer)."""
        self.process.stdin.write(f"delay {delay_ms} {jitter_ms}\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except OSError:
                pass
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()


def link_sweep(args, delays: list[float], combos: list[tuple[str, str]], ports: dict[str, int], root: Path,
               services: dict[str, subprocess.Popen], bare: dict) -> dict:
    """Time every (delay, combo, γ, draft-ahead) cell, interleaved over --link-repeats repeats
    (see the module docstring). Per cell: the chunk times, CPU per process and one tally per
    repeat; the bare calls per delay; which coordinator served each cell."""
    gammas = [int(g) for g in args.gammas.split(",")]
    per = max(1, math.ceil(args.requests / args.link_repeats))
    routes = (["direct"] if 0 in delays else []) + (["link"] if any(d > 0 for d in delays) else [])
    modes = ["off"] + (["on"] if any(g > 0 for g in gammas) else [])
    draft_only = coordinator_pb2.PROPOSER_DRAFT
    proxies: dict[str, LinkProcess] = {}
    coordinators: dict[tuple, tuple[subprocess.Popen, int]] = {}
    channels: list[grpc.Channel] = []
    cells: dict[tuple, dict] = {}
    bare_link: dict[float, list[float]] = {d: [] for d in delays if d > 0}
    try:
        if "link" in routes:
            first = next(d for d in delays if d > 0)
            proxies = {name: LinkProcess(f"127.0.0.1:{ports[name]}", first, jitter_of(args, first), seed=i)
                       for i, name in enumerate(("draft", "target"))}
        direct = {name: f"127.0.0.1:{ports[name]}" for name in ("draft", "target")}
        for route in routes:
            addresses = {name: proxy.address for name, proxy in proxies.items()} if route == "link" else direct
            for mode in modes:
                for overlap, transport in combos:
                    coordinators[route, mode, overlap, transport] = start_coordinator(
                        args, f"link-{route}-{mode}-{overlap}-{transport}", addresses["draft"], addresses["target"],
                        overlap, transport, root, ahead=mode, share_cores="no")
        everyone = [*services.values(), *(proxy.process for proxy in proxies.values()),
                    *(child for child, _ in coordinators.values())]
        for _, port in coordinators.values():
            wait_healthy(f"127.0.0.1:{port}", 300, everyone)
        stubs = {}
        for key, (_, port) in coordinators.items():
            channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
            stubs[key] = coordinator_pb2_grpc.CoordinatorStub(channels[-1])
        bare_stubs = None
        if proxies:
            channels += [grpc.insecure_channel(proxies["draft"].address),
                         grpc.insecure_channel(proxies["target"].address)]
            bare_stubs = (draft_pb2_grpc.DraftServiceStub(channels[-2]),
                          target_pb2_grpc.TargetServiceStub(channels[-1]))

        def pids(key: tuple) -> dict[str, int]:
            return {"coordinator": coordinators[key][0].pid, "client": os.getpid(),
                    **{name: service.pid for name, service in services.items()},
                    **{f"proxy_{name}": proxy.pid for name, proxy in proxies.items()}}

        for key, stub in stubs.items():  # warm-up, at the first delay
            for gamma in gammas:
                if gamma > 0 or key[1] == "off":
                    chunk_times(stub, gamma, 2, 16, pids(key), draft_only if gamma else 0)
        for repeat in range(args.link_repeats):
            for delay in delays if repeat % 2 == 0 else delays[::-1]:
                if delay > 0:
                    for proxy in proxies.values():
                        proxy.set_delay(delay, jitter_of(args, delay))
                    time.sleep(0.05)
                    bare_link[delay] += bare_times(*bare_stubs, 30)
                for overlap, transport in combos:
                    for gamma in gammas:
                        for mode in (modes if repeat % 2 == 0 else modes[::-1]) if gamma > 0 else ["off"]:
                            key = ("link" if delay > 0 else "direct", mode, overlap, transport)
                            proposer = draft_only if gamma else 0
                            chunk_times(stubs[key], gamma, 1, 16, pids(key), proposer)  # settles the switch
                            tally: dict = {}
                            stamps, cpu = chunk_times(stubs[key], gamma, per, args.max_new_tokens, pids(key),
                                                      proposer, tally)
                            cell = cells.setdefault((delay, overlap, transport, gamma, mode), {
                                "coordinator": f"link-{key[0]}-{mode}-{overlap}-{transport}",
                                "stamps": [], "tallies": [], "cpu": {name: 0.0 for name in cpu}})
                            cell["stamps"] += stamps
                            cell["tallies"].append(tally)
                            for name, seconds in cpu.items():
                                total = cell["cpu"][name]
                                cell["cpu"][name] = None if seconds is None or total is None else total + seconds
    finally:
        for channel in channels:
            channel.close()
        for child, _ in coordinators.values():
            child.stdin.close()
        for child, _ in coordinators.values():
            child.wait(60)
        for proxy in proxies.values():
            proxy.close()
    bare_ms = {d: {"p50": percentile(t, 0.5), "p99": percentile(t, 0.99)} for d, t in bare_link.items()}
    if 0 in delays:
        bare_ms[0.0] = bare
    return {"cells": cells, "bare": bare_ms, "requests_per_repeat": per}


def link_results(args, delays: list[float], sweep: dict, root: Path, work: Intervals, forwards: Intervals,
                 handlers: Intervals) -> dict:
    """The sweep's rows (one per cell: per-round times as `rounds` gives them with the model work
    counted once where the draft and the target overlap, tokens/s, GenerationStats sums, CPU
    per round) and, per delay and γ > 0, drafting ahead on against off."""
    spans: dict[str, tuple[Intervals, Intervals]] = {}
    rows: dict[str, dict] = {}
    for (delay, overlap, transport, gamma, mode), cell in sweep["cells"].items():
        name = cell["coordinator"]
        if name not in spans:
            coordinator = json.loads((root / f"coordinator-{name}.json").read_text())
            spans[name] = tuple(Intervals([tuple(s) for s in coordinator[kind]]) for kind in ("calls", "saves"))
        row = rounds(gamma, cell["stamps"], work, forwards, handlers, *spans[name])
        del row["samples"]
        tallies = cell["tallies"]
        tokens, seconds = sum(t["tokens"] for t in tallies), sum(t["seconds"] for t in tallies)
        n = max(1, row["rounds"])
        rows[link_key(delay, overlap, transport, gamma, mode)] = {
            "delay_ms": delay, "jitter_ms": jitter_of(args, delay), "overlap": overlap, "transport": transport,
            "draft_ahead": mode, **row,
            "wall_mean": 1000 * seconds / n, "tokens": tokens, "tokens_per_round": tokens / n,
            "tokens_per_s": tokens / seconds if seconds else None,
            "ms_per_token": 1000 * seconds / tokens if tokens else None,
            "repeat_tokens_per_s": [t["tokens"] / t["seconds"] if t["seconds"] else None for t in tallies],
            **{f"stats_{key}": sum(t[key] for t in tallies) for key in STAT_FIELDS},
            **{f"cpu_{name}_ms": None if s is None else 1000 * s / n for name, s in cell["cpu"].items()}}
    ahead: dict[str, dict] = {}
    for on in rows.values():
        off = rows.get(link_key(on["delay_ms"], on["overlap"], on["transport"], on["gamma"], "off"))
        if on["draft_ahead"] != "on" or off is None or not on["tokens_per_s"] or not off["tokens_per_s"]:
            continue
        per_repeat = [a / b for a, b in zip(on["repeat_tokens_per_s"], off["repeat_tokens_per_s"]) if a and b]
        ahead[link_key(on["delay_ms"], on["overlap"], on["transport"], on["gamma"], "")] = {
            "delay_ms": on["delay_ms"], "overlap": on["overlap"], "transport": on["transport"], "gamma": on["gamma"],
            "ms_per_token_off": off["ms_per_token"], "ms_per_token_on": on["ms_per_token"],
            "tokens_per_s_off": off["tokens_per_s"], "tokens_per_s_on": on["tokens_per_s"],
            "ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "repeat_ratios": per_repeat,
            "draft_ahead_calls": on["stats_draft_ahead_calls"], "draft_ahead_rounds": on["stats_draft_ahead_rounds"],
            "draft_rounds": on["stats_draft_rounds"], "rounds_in_stats": on["stats_rounds"],
            "draft_ahead_calls_off": off["stats_draft_ahead_calls"]}
    return {"delays_ms": delays, "jitter_ms": {f"{d:g}": jitter_of(args, d) for d in delays},
            "repeats": args.link_repeats, "requests_per_repeat": sweep["requests_per_repeat"],
            "max_new_tokens": args.max_new_tokens, "tiers_share_cores": "no", "proposer_when_gamma": "draft",
            "bare_two_calls_ms": {f"{d:g}": v for d, v in sweep["bare"].items()}, "rows": rows, "draft_ahead": ahead}


def link_key(delay: float, overlap: str, transport: str, gamma: int, mode: str) -> str:
    return f"delay_{delay:g}_{overlap}_{transport}_gamma_{gamma}" + (f"_ahead_{mode}" if mode else "")


def report_link(args, link: dict) -> None:
    print(f"\nlink sweep (bench/link_proxy.py: one proxy process per service; each direction delayed D ± J, "
          f"a call's round trip 2D; D = 0: loopback, no proxy), tiny {args.pair} pair; γ > 0 requests "
          f"proposer draft, the coordinators --draft-ahead on | off with --tiers-share-cores no; "
          f"{link['repeats']} interleaved repeats of {link['requests_per_repeat']} requests per cell, "
          f"{link['max_new_tokens']} tokens each")
    print("(bare×2: two bare unary calls through the links, p50; +call: what the link added to each, "
          "(bare×2 − bare×2 at D = 0) / 2, where D = 0 was measured)")
    print(f"{'D':>5} {'J':>5} {'bare×2':>7} {'+call':>6} {'overlap':>7} {'rpc':>6} {'γ':>3} {'ahead':>5} {'rounds':>6} "
          f"{'tok/rnd':>7} {'wall p50':>9} {'wall mean':>9} {'model p50':>9} {'orch p50':>9} {'orch p99':>9} | "
          f"{'CPU coord':>9} {'proxies':>8}   (ms per round)")
    rows = link["rows"]
    for r in sorted(rows.values(), key=lambda r: (r["overlap"], r["transport"], r["delay_ms"], -r["gamma"],
                                                  r["draft_ahead"])):
        bare = link["bare_two_calls_ms"][f"{r['delay_ms']:g}"]["p50"]
        loopback = link["bare_two_calls_ms"].get("0")
        added = "-" if loopback is None else format((bare - loopback["p50"]) / 2, ".3f")
        proxies = [r.get(f"cpu_proxy_{n}_ms") for n in ("draft", "target")]
        proxies = sum(proxies) if None not in proxies and proxies[0] is not None else None
        coord = r.get("cpu_coordinator_ms")
        print(f"{r['delay_ms']:>5g} {r['jitter_ms']:>5g} {bare:>7.3f} {added:>6} {r['overlap']:>7} {r['transport']:>6} "
              f"{r['gamma']:>3} {r['draft_ahead'] if r['gamma'] else '-':>5} {r['rounds']:>6} "
              f"{r['tokens_per_round']:>7.2f} {r['wall_p50']:>9.3f} {r['wall_mean']:>9.3f} {r['work_p50']:>9.3f} "
              f"{r['orchestration_p50']:>9.3f} {r['orchestration_p99']:>9.3f} | "
              f"{'n/a' if coord is None else format(coord, '.3f'):>9} "
              f"{'-' if proxies is None or r['delay_ms'] == 0 else format(proxies, '.3f'):>8}")
    if not link["draft_ahead"]:
        return
    print("\ndrafting ahead on against off, per delay (the timed rounds' tokens over their wall time; on/off: "
          "the ratio of tokens/s pooled over the repeats, [lowest, highest] of the per-repeat ratios; "
          "from the 'on' requests' stats: calls made ahead per round, rounds drafted ahead per draft round)")
    print(f"{'D':>5} {'overlap':>7} {'rpc':>6} {'γ':>3} | {'ms/tok off':>10} {'ms/tok on':>10} {'tok/s off':>9} "
          f"{'tok/s on':>9} {'on/off':>6} {'repeats':>13} | {'ahead calls':>15} {'drafted ahead':>15}")
    for a in sorted(link["draft_ahead"].values(), key=lambda a: (a["overlap"], a["transport"], a["delay_ms"],
                                                                 -a["gamma"])):
        spread = f"[{min(a['repeat_ratios']):.2f}, {max(a['repeat_ratios']):.2f}]" if a["repeat_ratios"] else "-"
        calls = f"{a['draft_ahead_calls']}/{a['rounds_in_stats']}"
        drafted = f"{a['draft_ahead_rounds']}/{a['draft_rounds']}"
        print(f"{a['delay_ms']:>5g} {a['overlap']:>7} {a['transport']:>6} {a['gamma']:>3} | "
              f"{a['ms_per_token_off']:>10.3f} {a['ms_per_token_on']:>10.3f} {a['tokens_per_s_off']:>9.1f} "
              f"{a['tokens_per_s_on']:>9.1f} {a['ratio']:>6.3f} {spread:>13} | {calls:>15} {drafted:>15}")


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
    link = results.get("link")
    fig, axes = plt.subplots(1, 2 if link else 1, figsize=(12 if link else 6, 4), squeeze=False)
    ax = axes[0][0]
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
    if link:
        ax = axes[0][1]
        lines: dict[tuple, list[dict]] = {}
        for r in link["rows"].values():
            lines.setdefault((r["overlap"], r["transport"], r["gamma"], r["draft_ahead"]), []).append(r)
        for (overlap, transport, gamma, mode), rows in sorted(lines.items(), key=lambda kv: (-kv[0][2], kv[0])):
            rows.sort(key=lambda r: r["delay_ms"])
            label = f"γ={gamma}" + (f" ahead {mode}" if gamma else "") + f" ({overlap}, {transport})"
            ax.plot([r["delay_ms"] for r in rows], [r["wall_p50"] for r in rows], marker="o", label=f"{label} wall")
            ax.plot([r["delay_ms"] for r in rows], [r["orchestration_p50"] for r in rows], marker=".",
                    linestyle="--", label=f"{label} orch")
        ax.set_xlabel("one-way link delay D (ms; a call's round trip 2D)")
        ax.set_ylabel("per round, p50 (ms)")
        ax.legend(fontsize="small")
        ax.set_title("per-round time against link delay")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
