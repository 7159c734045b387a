"""Chaos soak: every tier replicated, each process on its own test host, faults injected on a
seeded schedule, and not one committed token lost.

Usage:
  python bench/chaos.py [--minutes 10] [--every 30] [--sessions 64] [--seed 0]
                        [--faults kill,cut,slow,redis] [--order random|cycle]
                        [--link-delay-ms 0.3] [--link-jitter-ms 0.1] [--slow-ms 20]
                        [--cut-s 10] [--slow-s 30] [--loopback] [--out bench/results]

Hosts (bench/netns.py): Redis, 2 draft, 2 target and 2 coordinator replicas, each in a network
namespace of its own behind a delaying TCP proxy (bench/link_proxy.py: every link one-way
--link-delay-ms ± --link-jitter-ms); the clients run in the root namespace, another host. Where
namespaces cannot be made the hosts are all 127.0.0.1 (the table says so). Models: a tiny random
pair in float64 (specdec_cli.tiny), so greedy output can be compared token for token.

Clients: --sessions workers, each a loop of requests to a random coordinator: new or continued
sessions, greedy or seeded sampling, a fixed or adaptive γ, proposers auto, draft and ngram;
inputs are token ids so the client knows every token a session must hold. A request that fails
with a retryable status (UNAVAILABLE, RESOURCE_EXHAUSTED, FAILED_PRECONDITION: a busy session or
a lost lease, DEADLINE_EXCEEDED) is retried as a real client would, after the server's
retry-after-ms hint where it gives one (a busy session: when it is free): it reads the session
(GetSession, any coordinator), checks that it holds everything the client was streamed, and
continues it for the tokens still owed.

Faults, one every --every seconds, drawn from --faults with --seed (--order cycle: in turn):
  kill   SIGKILL a random service process (coordinator, draft or target); restarted 3 s later
  cut    a random host's link down for --cut-s (its veth; on loopback its proxy refuses)
  slow   a random host's link at --slow-ms for --slow-s
  redis  SIGKILL Redis and restart it (append-only file, fsync always: it keeps what it acked)

Checks, printed as a table and written to <out>/chaos.json: committed tokens lost (what each
client saw against what Redis holds: must be 0); every greedy request's output against the
target model alone (identical); every error by status with a sample message (only documented
statuses; no INTERNAL or UNKNOWN; every request ends within its deadline); per-token latency
p50/p99 outside and inside fault windows (a fault's start to 5 s after it ended); RSS of every
process at the start and the end; the fault schedule and the seed that replays it.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chaos_clients import REQUEST_BUDGET_S, RETRYABLE, Client, GreedyCase, Tally  # noqa: E402
from bench.netns import Host, TestHosts  # noqa: E402
from bench.processes import free_port  # noqa: E402
from coordinator.sessions.redis_store import session_keys  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402

FAULTS = ("kill", "cut", "slow", "redis")
REPLICAS = ("draft-1", "draft-2", "target-1", "target-2", "coordinator-1", "coordinator-2")
HOSTS = ("redis", *REPLICAS)
DOCUMENTED = RETRYABLE | {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                          grpc.StatusCode.CANCELLED}
RESTART_AFTER_S = 3.0
RECOVERY_S = 5.0  # after a fault ends, still inside its window for the latency split


# ---- processes on hosts ---------------------------------------------------------------------------

@dataclass
class Service:
    """A process on its host, listening on 127.0.0.1:inner there, reached at host:public through
    its link proxy (which runs on the same host)."""

    name: str
    host: Host
    argv: list[str]
    inner: int
    public: int
    log: Path
    process: subprocess.Popen | None = None
    proxy: subprocess.Popen | None = None
    restarts: int = 0
    rss_start_mb: float | None = None

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.public}"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.host.command(self.argv), stdout=subprocess.DEVNULL, stderr=log)

    def start_proxy(self, delay_ms: float, jitter_ms: float, seed: int) -> None:
        listen = f"{self.host.address}:{self.public}"
        self.proxy = subprocess.Popen(
            self.host.command([sys.executable, str(ROOT / "bench" / "link_proxy.py"), "--listen", listen,
                               "--to", f"127.0.0.1:{self.inner}", "--delay-ms", str(delay_ms),
                               "--jitter-ms", str(jitter_ms), "--seed", str(seed)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proxy.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"the link proxy of {self.name} did not start: {line!r}")

    def link(self, command: str) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.stdin.write(command + "\n")
            self.proxy.stdin.flush()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def rss_mb(self) -> float | None:
        try:
            # `ip netns exec` execs the command: the pid is the service's own
            return round(psutil.Process(self.process.pid).memory_info().rss / 2**20, 1)
        except (psutil.Error, AttributeError):
            return None

    def stop(self) -> None:
        for proc in (self.process, self.proxy):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (self.process, self.proxy):
            if proc is not None:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()


def wait_ready(service: Service, timeout_s: float = 300.0) -> None:
    if service.name == "redis":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                redis.Redis(host=service.host.address, port=service.public, socket_timeout=2).ping()
                return
            except redis.RedisError:
                time.sleep(0.2)
        raise RuntimeError("redis did not come up")
    wait_healthy(service.address, timeout_s, [service.process])


def make_services(hosts: TestHosts, tmp: Path, draft: str, target: str) -> dict[str, Service]:
    base = [sys.executable, "-m", "specdec_cli", "--log-level", "INFO", "serve"]
    ports = {name: (free_port(), free_port()) for name in HOSTS}
    services: dict[str, Service] = {}

    def add(name: str, argv: list[str]) -> None:
        inner, public = ports[name]
        services[name] = Service(name, hosts[name], argv, inner, public, tmp / f"{name}.log")

    (tmp / "redis").mkdir()
    inner = ports["redis"][0]
    add("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(inner), "--save", "", "--appendonly", "yes",
                  "--appendfsync", "always", "--dir", str(tmp / "redis")])
    for name in REPLICAS:
        kind = name.split("-")[0]
        if kind != "coordinator":
            add(name, base + [kind, "--model", draft if kind == "draft" else target, "--dtype", "float64",
                              "--host", "127.0.0.1", "--port", str(ports[name][0]), "--max-sessions", "512"])
    address = {name: f"{hosts[name].address}:{ports[name][1]}" for name in HOSTS}
    for name in ("coordinator-1", "coordinator-2"):
        add(name, base + ["coordinator", "--host", "127.0.0.1", "--port", str(ports[name][0]),
                          "--draft", f"{address['draft-1']},{address['draft-2']}",
                          "--target", f"{address['target-1']},{address['target-2']}",
                          "--session-store", f"redis://{address['redis']}/0",
                          "--max-concurrent-generations", "256"])
    return services


# ---- faults ---------------------------------------------------------------------------------------

@dataclass
class Fault:
    kind: str
    target: str
    start: float        # seconds since the load started
    end: float = 0.0    # when it was over (the process healthy again, the link back)


class Faults(threading.Thread):
    """Injects one fault every `every` seconds until the deadline (module docstring)."""

    def __init__(self, args, hosts: TestHosts, services: dict[str, Service], started: float, deadline: float):
        super().__init__(daemon=True)
        self.args, self.hosts, self.services = args, hosts, services
        self.started, self.deadline = started, deadline
        self.rng = random.Random(args.seed)
        self.kinds = [k for k in args.faults.split(",") if k]
        self.done: list[Fault] = []
        self.failures: list[str] = []

    def run(self) -> None:
        index = 0
        while True:
            wake = self.started + (index + 1) * self.args.every
            if wake >= self.deadline - 5:
                return
            time.sleep(max(0.0, wake - time.monotonic()))
            kind = self.kinds[index % len(self.kinds)] if self.args.order == "cycle" else self.rng.choice(self.kinds)
            index += 1
            try:
                self.inject(kind)
            except Exception as exc:  # noqa: BLE001 - a fault that failed is reported, not fatal
                self.failures.append(f"{kind}: {exc!r}")

    def inject(self, kind: str) -> None:
        now = lambda: round(time.monotonic() - self.started, 2)  # noqa: E731
        if kind == "kill":
            fault = Fault(kind, self.rng.choice(REPLICAS), now())
            service = self.services[fault.target]
            service.kill()
            time.sleep(RESTART_AFTER_S)
            service.start()
            service.restarts += 1
            wait_ready(service)
        elif kind == "redis":
            fault = Fault(kind, "redis", now())
            service = self.services["redis"]
            service.kill()
            time.sleep(1.0)
            service.start()
            service.restarts += 1
            wait_ready(service)
        elif kind == "cut":
            fault = Fault(kind, self.rng.choice(HOSTS), now())
            service = self.services[fault.target]
            if not self.hosts.set_link(fault.target, False):
                service.link("cut")
            time.sleep(self.args.cut_s)
            if not self.hosts.set_link(fault.target, True):
                service.link("heal")
        elif kind == "slow":
            fault = Fault(kind, self.rng.choice(HOSTS), now())
            service = self.services[fault.target]
            service.link(f"delay {self.args.slow_ms} {self.args.slow_ms / 10}")
            time.sleep(self.args.slow_s)
            service.link(f"delay {self.args.link_delay_ms} {self.args.link_jitter_ms}")
        else:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULTS)}")
        fault.end = now()
        self.done.append(fault)


# ---- analysis -------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_split(gaps: list[tuple[float, float]], faults: list[Fault], started: float) -> dict:
    windows = [(started + f.start, started + f.end + RECOVERY_S) for f in faults]
    inside = [g for t, g in gaps if any(a <= t <= b for a, b in windows)]
    outside = [g for t, g in gaps if not any(a <= t <= b for a, b in windows)]
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {"outside": {"tokens": len(outside), "p50_ms": ms(percentile(outside, 0.5)),
                        "p99_ms": ms(percentile(outside, 0.99))},
            "inside": {"tokens": len(inside), "p50_ms": ms(percentile(inside, 0.5)),
                       "p99_ms": ms(percentile(inside, 0.99))}}


def check_greedy(target: str, cases: list[GreedyCase], limit: int, seed: int) -> dict:
    """Each greedy request's tokens against the target alone (transformers' greedy, float64)."""
    import torch

    from specdec.runtime.loader import load_model

    picked = cases if len(cases) <= limit else random.Random(seed).sample(cases, limit)
    loaded = load_model(target, "float64")
    loaded.model.generation_config.eos_token_id = None
    mismatched = []
    for case in picked:
        if not case.generated:
            continue
        ids = torch.tensor([case.history])
        with torch.no_grad():
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=len(case.generated), min_new_tokens=len(case.generated),
                                        do_sample=False, pad_token_id=0)
        expected = out[0, len(case.history):].tolist()
        if expected != case.generated:
            mismatched.append({"history_len": len(case.history), "got": case.generated, "expected": expected})
    return {"greedy_requests": len(cases), "greedy_checked": len(picked), "greedy_mismatched": len(mismatched),
            "mismatches": mismatched[:5]}


def lost_in_redis(client: redis.Redis, sessions: dict[str, list[int]]) -> tuple[int, int]:
    """(tokens checked, tokens a client knows a session holds that Redis does not)."""
    checked = lost = 0
    for sid, tokens in sessions.items():
        stored = [int(t) for t in client.lrange(session_keys(sid)[1], 0, -1)]
        checked += len(tokens)
        lost += sum(1 for i, t in enumerate(tokens) if i >= len(stored) or stored[i] != t)
    return checked, lost


# ---- the run --------------------------------------------------------------------------------------

def run_chaos(args, echo=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="specdec-chaos-") as tmp_name, \
            TestHosts(list(HOSTS), loopback=args.loopback) as hosts:
        tmp = Path(tmp_name)
        from specdec_cli.tiny import build_pair
        from specdec.tokenizer import load_tokenizer

        draft, target = (str(p) for p in build_pair(tmp / "models"))
        vocab = len(load_tokenizer(target))
        services = make_services(hosts, tmp, draft, target)
        echo(f"hosts: {'network namespaces on a bridge' if hosts.isolated else 'loopback (' + str(hosts.why_loopback) + ')'}")
        try:
            for i, service in enumerate(services.values()):
                service.start_proxy(args.link_delay_ms, args.link_jitter_ms, args.seed + i)
                service.start()
            for service in services.values():
                wait_ready(service)
            for service in services.values():
                service.rss_start_mb = service.rss_mb()
            tally = Tally()
            started = time.monotonic()
            deadline = started + args.minutes * 60
            coordinators = [services[n].address for n in ("coordinator-1", "coordinator-2")]
            clients = [Client(i, coordinators, vocab, tally, deadline, args.seed) for i in range(args.sessions)]
            threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
            faults = Faults(args, hosts, services, started, deadline)
            faults.start()
            for thread in threads:
                thread.start()
            hung = 0
            for thread in threads:
                thread.join(max(1.0, deadline + REQUEST_BUDGET_S + 30 - time.monotonic()))
                hung += thread.is_alive()
            faults.join(120)
            elapsed = time.monotonic() - started
            rss = {name: {"start_mb": s.rss_start_mb, "end_mb": s.rss_mb(), "restarts": s.restarts}
                   for name, s in services.items()}
            store = redis.Redis(host=services["redis"].host.address, port=services["redis"].public)
            checked, lost = lost_in_redis(store, tally.sessions)
            store.close()
        finally:
            for service in services.values():
                service.stop()
        greedy = check_greedy(target, tally.greedy, args.max_greedy_checks, args.seed)
    undocumented = {k: v for k, v in tally.errors.items() if grpc.StatusCode[k] not in DOCUMENTED}
    result = {
        "seed": args.seed, "minutes": args.minutes, "every_s": args.every, "sessions": args.sessions,
        "hosts": "netns" if hosts.isolated else f"loopback ({hosts.why_loopback})",
        "link_delay_ms": args.link_delay_ms, "link_jitter_ms": args.link_jitter_ms,
        "seconds": round(elapsed, 1), "requests": tally.requests, "retries": tally.retries,
        "failed_requests": tally.failed_requests, "overdue_requests": tally.overdue_requests,
        "hung_clients": hung, "generated_tokens": tally.tokens, "tokens_checked": checked,
        "lost_tokens": lost + tally.lost_seen, "lost_in_redis": lost, "lost_at_retries": tally.lost_seen,
        "errors": dict(tally.errors), "error_messages": tally.messages, "undocumented_errors": undocumented,
        "faults": [vars(f) for f in faults.done], "faults_by_kind": dict(Counter(f.kind for f in faults.done)),
        "fault_failures": faults.failures, "latency": latency_split(tally.token_gaps, faults.done, started),
        "rss": rss, **greedy,
    }
    result["clean"] = (result["lost_tokens"] == 0 and result["greedy_mismatched"] == 0 and not undocumented
                       and not hung and not result["overdue_requests"] and not faults.failures)
    for line in report_lines(result):
        echo(line)
    return result


def report_lines(r: dict) -> list[str]:
    lat = r["latency"]
    lines = [
        f"hosts: {r['hosts']}; links {r['link_delay_ms']} ± {r['link_jitter_ms']} ms one way; seed {r['seed']}",
        f"{'faults':>24} {'requests':>9} {'retries':>8} {'failed':>7} {'tokens':>8} {'checked':>8} {'lost':>5} "
        f"{'greedy':>7} {'identical':>10}",
        f"{json.dumps(r['faults_by_kind']):>24} {r['requests']:>9} {r['retries']:>8} {r['failed_requests']:>7} "
        f"{r['generated_tokens']:>8} {r['tokens_checked']:>8} {r['lost_tokens']:>5} {r['greedy_checked']:>7} "
        f"{r['greedy_checked'] - r['greedy_mismatched']:>10}",
        f"errors by status: {r['errors'] or 'none'}; undocumented: {r['undocumented_errors'] or 'none'}; "
        f"hung clients: {r['hung_clients']}; overdue requests: {r['overdue_requests']}",
        f"latency per token (ms): outside faults p50 {lat['outside']['p50_ms']} p99 {lat['outside']['p99_ms']} "
        f"({lat['outside']['tokens']} tokens); inside p50 {lat['inside']['p50_ms']} p99 {lat['inside']['p99_ms']} "
        f"({lat['inside']['tokens']} tokens)",
        f"{'process':<14} {'RSS start':>10} {'RSS end':>8} {'restarts':>9}",
    ]
    for name, m in r["rss"].items():
        lines.append(f"{name:<14} {m['start_mb'] or '-':>10} {m['end_mb'] or '-':>8} {m['restarts']:>9}")
    for name, message in r["error_messages"].items():
        lines.append(f"  {name}: {message}")
    lines.append("schedule: " + ", ".join(f"{f['kind']} {f['target']} @{f['start']:.0f}s" for f in r["faults"]))
    if r["fault_failures"]:
        lines.append(f"faults that failed: {r['fault_failures']}")
    lines.append("CLEAN" if r["clean"] else "NOT CLEAN")
    return lines


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients drive load")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent client workers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and the clients")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"kinds to draw from: {','.join(FAULTS)}")
    parser.add_argument("--order", choices=("random", "cycle"), default="random", help="draw faults or take them in turn")
    parser.add_argument("--link-delay-ms", type=float, default=0.3, help="one-way delay of every link")
    parser.add_argument("--link-jitter-ms", type=float, default=0.1, help="uniform jitter of every link")
    parser.add_argument("--slow-ms", type=float, default=20.0, help="one-way delay of a slowed link")
    parser.add_argument("--cut-s", type=float, default=10.0, help="how long a cut link stays down")
    parser.add_argument("--slow-s", type=float, default=30.0, help="how long a slowed link stays slow")
    parser.add_argument("--loopback", action="store_true", help="all hosts on 127.0.0.1 even where namespaces work")
    parser.add_argument("--max-greedy-checks", type=int, default=2000, help="greedy requests compared (a sample past it)")
    parser.add_argument("--out", default="bench/results", help="directory of chaos.json")
    args = parser.parse_args(argv)
    unknown = [k for k in args.faults.split(",") if k and k not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}: choose from {', '.join(FAULTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a terminated run still removes its processes and namespaces (the `finally`s above)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result = run_chaos(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'chaos.json'}")
    return 0 if result["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
