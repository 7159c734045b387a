"""Does specdec keep pace with a GPU? Its rate on the timed device against the device-bound rate.

Usage:
  python bench/pace.py [--table h200-7b] [--gpu-json FILE] [--modes target,g4,auto]
                       [--sessions 1,4,16,64] [--link-delay-ms 0,0.5,1,2] [--ahead on,off]
                       [--max-new-tokens 64] [--context 512] [--out bench/results]

Runs the draft and the target on the timed device (bench/timed_device.py: a tiny model's exact
tokens, each forward held for the time the cost table gives a GPU; bench/pace_tables.py) as
processes of their own, a near-copy pair (bench/overhead_links.py's near_draft: the target's
weights slightly perturbed, α about 0.9), and a coordinator process per (link, drafting ahead).
Each case streams `--sessions` concurrent greedy requests of --max-new-tokens each through it:
  target  target-only (γ = 0);
  g4      the draft at γ = 4;
  auto    the draft at the coordinator's adaptive γ.
Links: 0 is loopback; D > 0 puts a delaying proxy (bench/link_proxy.py, a process each) in
front of each service, each direction delayed by D ms (±D/10). γ > 0 cases run with the
coordinator's --draft-ahead on and off (--tiers-share-cores no, as on separate hosts).

Per case it prints the rate (tokens/s over all sessions) against the device-bound rate: what
the table allows with zero overhead for the tokens per session-round measured in that case, the
sessions batched into one forward (a round at the device = the draft's γ-step loop, then the
target's forward of γ + 1 tokens, on --context cached tokens a row; no overlap). And the CPU per
session-round of each process (coordinator, draft, target, proxies, client; /proc), and the
forwards whose real compute ran over the table (then the device is slower than the table).
Writes JSON and a PNG under --out. The figures of a 2-core shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overhead  # noqa: E402
from bench.overhead_links import LinkProcess, near_draft, parse_delays  # noqa: E402
from bench.pace_tables import DevicePair  # noqa: E402
from bench.processes import cpu_of, cpu_spent  # noqa: E402
from bench.timed_device import TimedServices, device_pair  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from specdec_cli import tiny  # noqa: E402

MODES = {"target": 0, "g4": 4, "auto": None}  # γ of each mode (None: the coordinator's adaptive γ)
PROCESSES = ("coordinator", "draft", "target", "proxy_draft", "proxy_target", "client")


def request(mode: str, index: int, max_new: int) -> coordinator_pb2.GenerateRequest:
    gamma = MODES[mode]
    fields = {"proposer": coordinator_pb2.PROPOSER_NONE} if gamma == 0 else {"proposer": coordinator_pb2.PROPOSER_DRAFT}
    if gamma:
        fields["num_speculative_tokens"] = gamma
    return coordinator_pb2.GenerateRequest(
        prompt=f"def f{index}(x):", max_new_tokens=max_new, ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0), **fields)


async def one_session(stub, mode: str, index: int, max_new: int) -> dict:
    tokens, stats = 0, None
    async for chunk in stub.Generate(request(mode, index, max_new), timeout=600):
        tokens += len(chunk.token_ids)
        if chunk.HasField("stats"):
            stats = chunk.stats
    return {"tokens": tokens, "rounds": stats.rounds if stats else 0,
            "draft_rounds": stats.draft_rounds if stats else 0, "draft_tokens": stats.draft_tokens if stats else 0,
            "accepted_tokens": stats.accepted_tokens if stats else 0}


async def run_sessions(address: str, mode: str, sessions: int, max_new: int, pids: dict[str, int]) -> dict:
    """`sessions` concurrent streams; their sums, the wall time and each process's CPU."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        await asyncio.gather(*(one_session(stub, mode, i, 8) for i in range(min(sessions, 4))))  # warm-up
        before, start = cpu_of(pids), time.perf_counter()
        done = await asyncio.gather(*(one_session(stub, mode, i, max_new) for i in range(sessions)))
        wall, after = time.perf_counter() - start, cpu_of(pids)
    total = {key: sum(d[key] for d in done) for key in done[0]}
    return {**total, "wall_s": wall, "cpu_s": cpu_spent(before, after)}


def device_bound(pair: DevicePair, mode: str, sessions: int, measured: dict, context: int) -> dict:
    """The rate the table allows with zero overhead for this case's measured tokens per
    session-round: tokens/s, and the device's time per round (ms)."""
    rounds = max(1, measured["rounds"])
    per_round = measured["tokens"] / rounds  # tokens a session-round yields
    drafted = MODES[mode] != 0 and measured["draft_rounds"] > 0
    gamma = measured["draft_tokens"] / measured["draft_rounds"] if drafted else 0.0  # per draft call
    share = measured["draft_rounds"] / rounds if drafted else 0.0  # rounds with a draft call
    draft = share * pair.draft.draft_loop_seconds(sessions, round(gamma), context)
    target = pair.target.seconds(sessions, round(measured["draft_tokens"] / rounds) + 1, context)
    seconds = draft + target
    return {"tokens_per_round": per_round, "gamma": gamma, "device_round_ms": 1e3 * seconds,
            "rate": sessions * per_round / seconds}


def case_row(pair: DevicePair, mode: str, sessions: int, delay: float, ahead: str, measured: dict,
             context: int) -> dict:
    bound = device_bound(pair, mode, sessions, measured, context)
    rate = measured["tokens"] / measured["wall_s"]
    session_rounds = max(1, measured["rounds"])
    return {"mode": mode, "sessions": sessions, "delay_ms": delay, "ahead": ahead, "rate": rate,
            "bound_rate": bound["rate"], "of_bound": rate / bound["rate"], **{k: v for k, v in bound.items() if k != "rate"},
            "tokens": measured["tokens"], "session_rounds": measured["rounds"], "wall_s": measured["wall_s"],
            "orchestration_ms_per_round": 1e3 * (measured["wall_s"] * sessions / session_rounds) - bound["device_round_ms"],
            **{f"cpu_{name}_ms": None if s is None else 1e3 * s / session_rounds for name, s in measured["cpu_s"].items()}}


def coordinator_cases(args, ahead: str, first: bool) -> list[tuple[str, str]]:
    """(mode, drafting ahead) of the cases a coordinator with --draft-ahead `ahead` runs:
    the γ > 0 modes; target-only (ahead '-') on the first coordinator of a link alone."""
    return [(mode, ahead if MODES[mode] != 0 else "-") for mode in args.modes.split(",")
            if MODES[mode] != 0 or first]


def run(args, pair: DevicePair, root: Path) -> list[dict]:
    target = tiny.build_pair(root)[1]
    models = {"target": target, "draft": near_draft(target, root / "draft-near")}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.torch_threads)) if args.torch_threads else None
    services = TimedServices(models, args.table, root, gpu_json=args.gpu_json, spin_us=args.spin_us, env=env)
    proxies: dict[str, LinkProcess] = {}
    rows: list[dict] = []
    try:
        services.wait_ready()
        for delay in parse_delays(args.link_delay_ms):
            if delay and not proxies:
                proxies = {name: LinkProcess(services.address(name), delay, delay / 10) for name in ("draft", "target")}
            for proxy in proxies.values():
                proxy.set_delay(delay, delay / 10)
            addresses = {name: proxies[name].address if delay else services.address(name) for name in ("draft", "target")}
            for i, ahead in enumerate(args.ahead.split(",")):
                chosen = coordinator_cases(args, ahead, i == 0)
                if chosen:
                    rows += run_coordinator(args, pair, root, services, proxies, addresses, delay, ahead, chosen)
    finally:
        for proxy in proxies.values():
            proxy.close()
        timed = services.close()
    for row in rows:
        row["overruns"] = {name: timed[name].get("overruns") for name in timed}
    args.timed = timed
    return rows


def run_coordinator(args, pair, root, services, proxies, addresses, delay, ahead, chosen) -> list[dict]:
    """One coordinator (--draft-ahead `ahead`, --tiers-share-cores no) and its cases."""
    tag = f"pace-{delay}-{ahead}"
    child, port = overhead.start_coordinator(args, tag, addresses["draft"], addresses["target"], "on", "stream", root,
                                             ahead, "no")
    rows = []
    try:
        wait_healthy(f"127.0.0.1:{port}", 300, [child, *services.children.values()])
        pids = {"coordinator": child.pid, "client": os.getpid(),
                **{name: c.pid for name, c in services.children.items()},
                **{f"proxy_{name}": p.pid for name, p in proxies.items()}}
        for mode, case_ahead in chosen:
            for sessions in [int(s) for s in args.sessions.split(",")]:
                measured = asyncio.run(run_sessions(f"127.0.0.1:{port}", mode, sessions, args.max_new_tokens, pids))
                row = case_row(pair, mode, sessions, delay, case_ahead, measured, args.context)
                rows.append(row)
                print_row(row, flush=True)
    finally:
        child.stdin.close()
        child.wait(60)
    return rows


COLUMNS = ("coordinator", "draft", "target", "proxy_draft", "proxy_target", "client")


def print_header(pair: DevicePair) -> None:
    d = pair.describe()
    print(f"\ntimed device {d['name']}: target {d['target']['shape']} {d['target']['decode_ms']:.2f} ms a decode step, "
          f"draft {d['draft']['shape']} {d['draft']['decode_ms']:.2f} ms")
    print(f"{'mode':>6} {'ahead':>5} {'link':>5} {'sess':>4} | {'tok/s':>8} {'bound':>8} {'of bound':>8} "
          f"{'tok/rnd':>7} {'orch ms':>7} | CPU ms per session-round: "
          + " ".join(f"{c.replace('proxy_', 'px_'):>8}" for c in COLUMNS))


def print_row(row: dict, flush: bool = False) -> None:
    cpu = " ".join("     n/a" if row.get(f"cpu_{c}_ms") is None else f"{row[f'cpu_{c}_ms']:>8.3f}" for c in COLUMNS)
    print(f"{row['mode']:>6} {row['ahead']:>5} {row['delay_ms']:>5g} {row['sessions']:>4} | {row['rate']:>8.1f} "
          f"{row['bound_rate']:>8.1f} {row['of_bound']:>8.2f} {row['tokens_per_round']:>7.2f} "
          f"{row['orchestration_ms_per_round']:>7.2f} | {'':>26}{cpu}", flush=flush)


def plot(path: Path, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    lines: dict[tuple, list[dict]] = {}
    for row in rows:
        lines.setdefault((row["mode"], row["ahead"], row["delay_ms"]), []).append(row)
    for (mode, ahead, delay), group in sorted(lines.items()):
        group.sort(key=lambda r: r["sessions"])
        ax.plot([r["sessions"] for r in group], [r["of_bound"] for r in group], marker="o",
                label=f"{mode} ahead {ahead} link {delay:g} ms")
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("rate / device-bound rate")
    ax.set_title("specdec on the timed device (tiny models, exact tokens, GPU times)")
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="h200-7b", help="the timed device's cost table (bench/pace_tables.py)")
    parser.add_argument("--gpu-json", default="", help="the target's times from this bench/gpu.py JSON")
    parser.add_argument("--modes", default="target,g4,auto")
    parser.add_argument("--sessions", default="1,4,16,64")
    parser.add_argument("--link-delay-ms", default="0,0.5,1,2")
    parser.add_argument("--ahead", default="on,off", help="drafting ahead for γ > 0: on, off or on,off")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="cached tokens a row the device bound assumes")
    parser.add_argument("--spin-us", type=float, default=100.0, help="the timed device spins the last µs of a hold")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of each service (0: torch's)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    bad = [m for m in args.modes.split(",") if m not in MODES] + [a for a in args.ahead.split(",") if a not in ("on", "off")]
    if bad:
        parser.error(f"unknown mode or --ahead value: {', '.join(bad)}")
    args.store = "memory"  # what overhead.start_coordinator reads
    pair = device_pair(args.table, args.gpu_json)
    root = Path(tempfile.mkdtemp(prefix="specdec-pace-"))
    print_header(pair)
    rows = run(args, pair, root)
    print(f"timed device: {json.dumps(args.timed)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pace.json").write_text(json.dumps({"device": pair.describe(), "timed": args.timed, "load": os.getloadavg(),
                                               "args": {k: v for k, v in vars(args).items() if k != "timed"},
                                               "rows": rows}, indent=2))
    plot(out / "pace.png", rows)
    print(f"wrote {out / 'pace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
