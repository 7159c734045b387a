"""bench/overhead.py's link sweep (--link-delay-ms): the delays it takes and the jitter of each,
the delaying proxy process (bench/link_proxy.py) it puts in front of each service, the near
draft of --pair near, the order in which it times its cells (interleaved over the repeats,
drafting ahead on and off), and how the timed cells become its rows, its comparison of
drafting ahead on against off, and its tables."""

from __future__ import annotations

import json
import math
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import grpc

from bench.overhead_timing import STAT_FIELDS, Intervals, bare_times, chunk_times, percentile, rounds
from specdec.rpc.health import wait_healthy
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc, draft_pb2_grpc, target_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


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
               services: dict[str, subprocess.Popen], bare: dict,
               start_coordinator: Callable[..., tuple[subprocess.Popen, int]]) -> dict:
    """Time every (delay, combo, γ, draft-ahead) cell, interleaved over --link-repeats repeats
    (see bench/overhead.py's docstring). Per cell: the chunk times, CPU per process and one tally
    per repeat; the bare calls per delay; which coordinator served each cell. The coordinators
    are started with `start_coordinator` (bench/overhead.py's: children of that script)."""
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
