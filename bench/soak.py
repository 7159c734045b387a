"""Soak: N concurrent sessions for T minutes against the three services + Redis on loopback.

Usage:
  python bench/soak.py [--sessions 32] [--minutes 2] [--draft-model D --target-model T]
                       [--redis-url URL] [--dtype float32] [--kv-cache-bytes B] [--max-sessions S]
                       [--sample-seconds 5] [--warmup-minutes 1]

Without models it builds a tiny random pair; without --redis-url it starts its own
redis-server on a free port. Each worker mixes new and continued sessions, greedy and seeded
sampling, γ from 0 to 5. Inputs are token ids, so the client knows every token a session must
hold; afterwards each session in Redis is checked against that (lost tokens).

Memory: the draft and target run with the given cache budget (--kv-cache-bytes, --max-sessions;
by default a byte budget the soak reaches within a minute, since sessions are never released and
new ones start all along). Every --sample-seconds the soak records each service's RSS and the
draft's and target's specdec_kv_cache_bytes (scraped from their --metrics-port), and once more
after the load stops. The budget holds when, after the load, every cache total is within it,
and under load no sample passes it by more than the sessions of one running call can add (the
budget is applied after each call and never evicts that call's own sessions). RSS is reported
at the end of warm-up and at the end, with its growth after warm-up (MB and MB/min, the slope
of the samples); evictions are counted from the services' INFO log. Prints a table and writes
bench/results/soak.json and soak.png (RSS and KV bytes over time, the budget as a line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import free_port  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

MAX_SESSION_TOKENS = 400  # the tiny models' context is 512
GAUGES = ("specdec_kv_cache_bytes", "specdec_cached_sessions")


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    errors: Counter = field(default_factory=Counter)
    expected: dict[str, list[int]] = field(default_factory=dict)  # session -> tokens it must hold
    lock: threading.Lock = field(default_factory=threading.Lock)


def worker(address: str, deadline: float, seed: int, vocab: int, tally: Tally) -> None:
    rng = random.Random(seed)
    session_id, held = "", 0
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while time.monotonic() < deadline:
            inputs = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 12))]
            max_new = rng.randint(4, 24)
            if not session_id or rng.random() < 0.35 or held + len(inputs) + max_new > MAX_SESSION_TOKENS:
                session_id, held = "", 0
            sampling = common_pb2.SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1 << 30))
            request = coordinator_pb2.GenerateRequest(
                session_id=session_id, token_ids=coordinator_pb2.TokenIds(ids=inputs), sampling=sampling,
                max_new_tokens=max_new, num_speculative_tokens=rng.randint(0, 5), ignore_eos=rng.random() < 0.5)
            generated, sid = [], session_id
            try:
                for chunk in stub.Generate(request, timeout=120):
                    sid = chunk.session_id
                    generated.extend(chunk.token_ids)
                with tally.lock:
                    tally.requests += 1
                    tally.tokens += len(generated)
                    tally.expected.setdefault(sid, []).extend(inputs + generated)
                session_id, held = sid, held + len(inputs) + len(generated)
            except grpc.RpcError as exc:
                with tally.lock:
                    tally.requests += 1
                    tally.errors[exc.code().name] += 1
                session_id, held = "", 0


# ---- sampling memory over time ------------------------------------------------------------------

def scrape_gauges(port: int, names: tuple[str, ...] = GAUGES) -> dict[str, float]:
    """The named gauges of a service's /metrics endpoint (GET over HTTP)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and not sample.labels:
                out[sample.name] = sample.value
    return out


def take_sample(started: float, pids: dict[str, int], metrics_ports: dict[str, int]) -> dict:
    """One point in time: every service's RSS (MB) and the model services' cache gauges."""
    point: dict = {"t": round(time.monotonic() - started, 2)}
    for name, pid in pids.items():
        entry = {"rss_mb": round(psutil.Process(pid).memory_info().rss / 2**20, 2)}
        if name in metrics_ports:
            gauges = scrape_gauges(metrics_ports[name])
            entry["kv_bytes"] = int(gauges.get("specdec_kv_cache_bytes", 0))
            entry["cached_sessions"] = int(gauges.get("specdec_cached_sessions", 0))
        point[name] = entry
    return point


class Sampler(threading.Thread):
    """Takes a sample every `every` seconds until stopped (a failed scrape is counted, not fatal:
    a soak is not stopped by its own instrumentation)."""

    def __init__(self, started: float, pids: dict[str, int], metrics_ports: dict[str, int], every: float):
        super().__init__(daemon=True)
        self.started, self.pids, self.metrics_ports, self.every = started, pids, metrics_ports, every
        self.samples: list[dict] = []
        self.failures = 0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        try:
            self.samples.append(take_sample(self.started, self.pids, self.metrics_ports))
        except (OSError, psutil.Error):
            self.failures += 1

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.every)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def evictions_logged(path: Path) -> int:
    """Session caches a service evicted, from its INFO log ("evicted N session cache(s)")."""
    pattern = re.compile(r"evicted (\d+) session cache")
    return sum(int(m.group(1)) for m in pattern.finditer(path.read_text(errors="replace")))


# ---- analysis -----------------------------------------------------------------------------------

def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute (0 with fewer than 2 points)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def in_flight_allowance(bytes_per_token: int, sessions: int, max_batch_size: int = 32) -> int:
    """The most a cache total can pass its budget while a call runs: the budget is applied after
    each call and never evicts that call's own sessions, so they may grow above it meanwhile. At
    most min(sessions, max batch) sessions share a call, each at most a full session's buffer."""
    from specdec.runtime.torch.kv_buffers import grown_capacity

    return min(sessions, max_batch_size) * grown_capacity(0, MAX_SESSION_TOKENS + 6) * bytes_per_token


def analyse_memory(samples: list[dict], idle: dict, budget: int, warmup_s: float,
                   allowances: dict[str, int]) -> dict[str, dict]:
    """Per service: KV bytes (max under load, after the load stopped) against the budget, and
    RSS at the end of warm-up, at the end, and its growth after warm-up (MB, MB/min)."""
    out: dict[str, dict] = {}
    for name in idle:
        series = [(s["t"], s[name]) for s in samples if name in s]
        warm = [(t, e) for t, e in series if t >= warmup_s] or series[-1:]
        rss_warm, rss_end = warm[0][1]["rss_mb"], idle[name]["rss_mb"]
        report = {"rss_mb_start": series[0][1]["rss_mb"], "rss_mb_warm": rss_warm, "rss_mb_end": rss_end,
                  "rss_mb_max": max(e["rss_mb"] for _, e in series),
                  "rss_growth_mb": round(rss_end - rss_warm, 2),
                  "rss_growth_mb_per_min": round(slope_per_minute([(t, e["rss_mb"]) for t, e in warm]), 3),
                  "warm_window_s": round(warm[-1][0] - warm[0][0], 1)}
        if "kv_bytes" in idle[name]:
            kv_max = max(e["kv_bytes"] for _, e in series)
            over = [e["kv_bytes"] for _, e in series if e["kv_bytes"] > budget]
            report.update(
                kv_budget=budget, kv_max=kv_max, kv_max_over_budget=max(0, kv_max - budget),
                kv_samples=len(series), kv_samples_over_budget=len(over), kv_idle=idle[name]["kv_bytes"],
                kv_allowance=allowances[name], cached_sessions_max=max(e["cached_sessions"] for _, e in series),
                kv_within_budget=idle[name]["kv_bytes"] <= budget and kv_max <= budget + allowances[name])
        out[name] = report
    return out


def run_soak(sessions: int = 32, seconds: float = 120.0, draft_model: str = "", target_model: str = "",
             redis_url: str = "", dtype: str = "float32", echo=print, kv_cache_bytes: int = 0,
             max_sessions: int = 256, sample_seconds: float = 5.0, warmup_seconds: float | None = None) -> dict:
    """kv_cache_bytes 0: a budget the soak surely reaches (default_budget). warmup_seconds None:
    a third of the run, at most a minute."""
    procs: list[subprocess.Popen] = []
    warmup = min(60.0, seconds / 3) if warmup_seconds is None else warmup_seconds
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as tmp:
        try:
            if not draft_model:
                from specdec_cli.tiny import build_pair

                draft, target = build_pair(tmp)
                draft_model, target_model = str(draft), str(target)
            from bench.kv_memory import model_bytes_per_token

            per_token = {"draft": model_bytes_per_token(draft_model, dtype),
                         "target": model_bytes_per_token(target_model, dtype)}
            budget = kv_cache_bytes or default_budget(sessions, per_token)
            allowances = {name: in_flight_allowance(b, sessions) for name, b in per_token.items()}
            if not redis_url:
                port = free_port()
                procs.append(subprocess.Popen(
                    ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                     "--appendonly", "no"], stdout=subprocess.DEVNULL))
                redis_url = f"redis://127.0.0.1:{port}/0"
            ports = {"draft": free_port(), "target": free_port(), "coordinator": free_port()}
            metrics_ports = {"draft": free_port(), "target": free_port()}
            base = [sys.executable, "-m", "specdec_cli", "--log-level", "INFO", "serve"]
            budget_flags = ["--kv-cache-bytes", str(budget), "--max-sessions", str(max_sessions)]
            commands = {
                name: base + [name, "--model", model, "--dtype", dtype, "--port", str(ports[name]),
                              "--metrics-port", str(metrics_ports[name]), *budget_flags]
                for name, model in (("draft", draft_model), ("target", target_model))}
            commands["coordinator"] = base + [
                "coordinator", "--draft", f"127.0.0.1:{ports['draft']}", "--target", f"127.0.0.1:{ports['target']}",
                "--port", str(ports["coordinator"]), "--session-store", redis_url,
                "--max-concurrent-generations", str(max(64, sessions))]
            pids, logs = {}, {}
            for names in (("draft", "target"), ("coordinator",)):  # the two models load side by side
                for name in names:
                    logs[name] = Path(tmp) / f"{name}.log"
                    with open(logs[name], "wb") as log_file:
                        proc = subprocess.Popen(commands[name], stdout=subprocess.DEVNULL, stderr=log_file)
                    procs.append(proc)
                    pids[name] = proc.pid
                for name in names:
                    wait_healthy(f"127.0.0.1:{ports[name]}", 300, procs)
            address = f"127.0.0.1:{ports['coordinator']}"
            from specdec.tokenizer import load_tokenizer

            vocab = len(load_tokenizer(target_model))
            tally = Tally()
            started = time.monotonic()
            sampler = Sampler(started, pids, metrics_ports, sample_seconds)
            sampler.start()
            deadline = started + seconds
            threads = [threading.Thread(target=worker, args=(address, deadline, i, vocab, tally))
                       for i in range(sessions)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - started
            sampler.stop()
            time.sleep(1.0)  # let calls the coordinator abandoned (a draft timeout) finish
            idle = take_sample(started, pids, metrics_ports)  # the load has stopped: every call finished
            evictions = {name: evictions_logged(logs[name]) for name in metrics_ports}
            client = redis.Redis.from_url(redis_url, decode_responses=True)
            lost = 0
            for sid, tokens in tally.expected.items():
                stored = [int(t) for t in client.lrange(f"specdec:session:{sid}:tokens", 0, -1)]
                lost += sum(1 for i, t in enumerate(tokens) if i >= len(stored) or stored[i] != t)
            client.close()
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    memory = analyse_memory(sampler.samples, {k: v for k, v in idle.items() if k != "t"}, budget, warmup,
                            allowances)
    for name, count in evictions.items():
        memory[name]["evictions"] = count
    result = {
        "sessions": sessions, "seconds": round(elapsed, 1), "requests": tally.requests,
        "distinct_sessions": len(tally.expected), "generated_tokens": tally.tokens,
        "errors": dict(tally.errors), "error_count": sum(tally.errors.values()),
        "committed_tokens_checked": sum(len(t) for t in tally.expected.values()), "lost_tokens": lost,
        "requests_per_second": round(tally.requests / elapsed, 2),
        "tokens_per_second": round(tally.tokens / elapsed, 1),
        "kv_cache_bytes": budget, "max_sessions": max_sessions, "kv_bytes_per_token": per_token,
        "warmup_seconds": warmup, "sample_seconds": sample_seconds, "sample_failures": sampler.failures,
        "memory": memory, "samples": sampler.samples + [idle],
    }
    result["kv_within_budget"] = all(m.get("kv_within_budget", True) for m in memory.values())
    for line in report_lines(result):
        echo(line)
    return result


def default_budget(sessions: int, per_token: dict[str, int]) -> int:
    """A KV budget the soak reaches within a minute: about 128 tokens per concurrent session of
    the larger model. Sessions are never released and workers start new ones all along, so the
    caches would grow far past it; the LRU must evict to hold it."""
    return max(sessions, 8) * 128 * max(per_token.values())


def report_lines(result: dict) -> list[str]:
    r = result
    lines = [f"{'sessions':>9} {'seconds':>8} {'requests':>9} {'errors':>7} {'tokens':>8} {'checked':>8} {'lost':>5}",
             f"{r['sessions']:>9} {r['seconds']:>8} {r['requests']:>9} {r['error_count']:>7} "
             f"{r['generated_tokens']:>8} {r['committed_tokens_checked']:>8} {r['lost_tokens']:>5}",
             f"errors by status: {r['errors'] or 'none'}",
             f"KV budget: --kv-cache-bytes {r['kv_cache_bytes']} ({r['kv_cache_bytes'] / 2**20:.2f} MiB), "
             f"--max-sessions {r['max_sessions']}; warm-up {r['warmup_seconds']:.0f} s; a sample every "
             f"{r['sample_seconds']} s",
             f"{'service':<12} {'KV max':>10} {'over':>9} {'>budget':>8} {'allow':>9} {'KV idle':>10} {'evicted':>8} "
             f"{'RSS warm':>9} {'RSS end':>8} {'growth':>7} {'MB/min':>7}"]
    for name, m in r["memory"].items():
        kv = (f"{m['kv_max']:>10} {m['kv_max_over_budget']:>9} {m['kv_samples_over_budget']:>3}/{m['kv_samples']:<4} "
              f"{m['kv_allowance']:>9} {m['kv_idle']:>10} {m['evictions']:>8}") if "kv_max" in m else \
            f"{'-':>10} {'-':>9} {'-':>8} {'-':>9} {'-':>10} {'-':>8}"
        lines.append(f"{name:<12} {kv} {m['rss_mb_warm']:>9.1f} {m['rss_mb_end']:>8.1f} {m['rss_growth_mb']:>7.1f} "
                     f"{m['rss_growth_mb_per_min']:>7.2f}")
    lines.append("KV bytes from specdec_kv_cache_bytes; over = max - budget; >budget = samples above it; allow = "
                 "what the sessions of one running call may add before the budget is applied after it; RSS in "
                 "MB at the end of warm-up and after the load; growth after warm-up (end - warm, and the slope)")
    verdict = "holds" if r["kv_within_budget"] else "BROKEN"
    hit = all(m.get("evictions", 1) > 0 for m in r["memory"].values())
    lines.append(f"KV budget {verdict} (after the load every cache total <= budget; under load <= budget + allow)"
                 + ("" if hit else "; WARNING: a service never evicted, so the budget was not reached"))
    return lines


def plot(result: dict, path: Path) -> bool:
    """RSS and KV bytes over time per service, the budget as a line, the warm-up's end marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = result["samples"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name in result["memory"]:
        mine = [s for s in samples if name in s]
        top.plot([s["t"] for s in mine], [s[name]["rss_mb"] for s in mine], label=name)
        if "kv_bytes" in mine[0][name]:
            bottom.plot([s["t"] for s in mine], [s[name]["kv_bytes"] / 2**20 for s in mine], label=name)
    bottom.axhline(result["kv_cache_bytes"] / 2**20, color="red", linestyle="--", label="budget")
    for ax in (top, bottom):
        ax.axvline(result["warmup_seconds"], color="grey", linestyle=":", label="warm-up end")
        ax.legend(fontsize=8)
    top.set_ylabel("RSS (MB)")
    bottom.set_ylabel("specdec_kv_cache_bytes (MiB)")
    bottom.set_xlabel("seconds into the soak")
    top.set_title(f"soak: {result['sessions']} sessions, {result['seconds']:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-bytes", type=int, default=0,
                        help="the draft's and target's --kv-cache-bytes (0 = one the soak reaches: 128 tokens "
                             "per session of the larger model)")
    parser.add_argument("--max-sessions", type=int, default=256, help="the draft's and target's --max-sessions")
    parser.add_argument("--sample-seconds", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="RSS growth is measured after this (default: a third of the run, at most 1)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warmup = None if args.warmup_minutes is None else args.warmup_minutes * 60
    result = run_soak(args.sessions, args.minutes * 60, args.draft_model, args.target_model, args.redis_url,
                      args.dtype, kv_cache_bytes=args.kv_cache_bytes, max_sessions=args.max_sessions,
                      sample_seconds=args.sample_seconds, warmup_seconds=warmup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    drawn = plot(result, out / "soak.png")
    print(f"wrote {out / 'soak.json'}" + (f" and {out / 'soak.png'}" if drawn else ""))
    ok = result["error_count"] == 0 and result["lost_tokens"] == 0 and result["kv_within_budget"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
