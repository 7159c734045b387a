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
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from draft_service import server as draft_server  # noqa: E402
from bench import transport_floor  # noqa: E402
from bench.overhead_links import link_results, link_sweep, near_draft, parse_delays, report_link  # noqa: E402
from bench.overhead_timing import Intervals, bare_calls, chunk_times, rounds  # noqa: E402
from bench.processes import cpu_columns, free_port  # noqa: E402
from specdec_cli import tiny  # noqa: E402
from specdec.config import DraftConfig, TargetConfig  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import coordinator_pb2_grpc, draft_pb2_grpc, target_pb2_grpc  # noqa: E402
from target_service import server as target_server  # noqa: E402


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
    engine = servicer.engine if args.serve == "draft" else servicer.engine
    engine.model.forward = forwards.wrap(engine.model.forward)
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
                               children, bare, start_coordinator)
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
