"""Soak: N concurrent sessions for T minutes against the three services + Redis on loopback.

Usage:
  python bench/soak.py [--sessions 32] [--minutes 2] [--draft-model D --target-model T]
                       [--redis-url URL] [--dtype float32]

Without models it builds a tiny random pair; without --redis-url it starts its own
redis-server on a free port. Each worker mixes new and continued sessions, greedy and seeded
sampling, γ from 0 to 5. Inputs are token ids, so the client knows every token a session must
hold; afterwards each session in Redis is checked against that (lost tokens). Prints a table
and writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.cli import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

MAX_SESSION_TOKENS = 400  # the tiny models' context is 512


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    return {name: round(psutil.Process(pid).memory_info().rss / 2**20, 1) for name, pid in pids.items()}


def run_soak(sessions: int = 32, seconds: float = 120.0, draft_model: str = "", target_model: str = "",
             redis_url: str = "", dtype: str = "float32", echo=print) -> dict:
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="specdec-soak-") as tmp:
        try:
            if not draft_model:
                from specdec.tiny import build_pair

                draft, target = build_pair(tmp)
                draft_model, target_model = str(draft), str(target)
            if not redis_url:
                port = _free_port()
                procs.append(subprocess.Popen(
                    ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                     "--appendonly", "no"], stdout=subprocess.DEVNULL))
                redis_url = f"redis://127.0.0.1:{port}/0"
            ports = {"draft": _free_port(), "target": _free_port(), "coordinator": _free_port()}
            base = [sys.executable, "-m", "specdec.cli", "serve"]
            commands = {
                "draft": base + ["draft", "--model", draft_model, "--dtype", dtype, "--port", str(ports["draft"])],
                "target": base + ["target", "--model", target_model, "--dtype", dtype, "--port",
                                  str(ports["target"])],
                "coordinator": base + ["coordinator", "--draft", f"127.0.0.1:{ports['draft']}", "--target",
                                       f"127.0.0.1:{ports['target']}", "--port", str(ports["coordinator"]),
                                       "--session-store", redis_url,
                                       "--max-concurrent-generations", str(max(64, sessions))],
            }
            pids = {}
            for name in ("draft", "target", "coordinator"):
                proc = subprocess.Popen(commands[name], stdout=subprocess.DEVNULL)
                procs.append(proc)
                pids[name] = proc.pid
                wait_healthy(f"127.0.0.1:{ports[name]}", 300, [proc])
            address = f"127.0.0.1:{ports['coordinator']}"
            rss_start = rss_mb(pids)
            from specdec.runtime.loader import load_tokenizer

            vocab = len(load_tokenizer(target_model))
            tally = Tally()
            started = time.monotonic()
            deadline = started + seconds
            threads = [threading.Thread(target=worker, args=(address, deadline, i, vocab, tally))
                       for i in range(sessions)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - started
            rss_end = rss_mb(pids)
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
    result = {
        "sessions": sessions, "seconds": round(elapsed, 1), "requests": tally.requests,
        "distinct_sessions": len(tally.expected), "generated_tokens": tally.tokens,
        "errors": dict(tally.errors), "error_count": sum(tally.errors.values()),
        "committed_tokens_checked": sum(len(t) for t in tally.expected.values()), "lost_tokens": lost,
        "rss_mb_start": rss_start, "rss_mb_end": rss_end,
        "requests_per_second": round(tally.requests / elapsed, 2),
        "tokens_per_second": round(tally.tokens / elapsed, 1),
    }
    echo(f"{'sessions':>9} {'seconds':>8} {'requests':>9} {'errors':>7} {'tokens':>8} {'checked':>8} {'lost':>5}")
    echo(f"{sessions:>9} {result['seconds']:>8} {tally.requests:>9} {result['error_count']:>7} "
         f"{tally.tokens:>8} {result['committed_tokens_checked']:>8} {lost:>5}")
    echo(f"errors by status: {result['errors'] or 'none'}")
    for name in rss_start:
        echo(f"RSS {name}: {rss_start[name]} MB -> {rss_end[name]} MB")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_soak(args.sessions, args.minutes * 60, args.draft_model, args.target_model, args.redis_url,
                      args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'soak.json'}")
    return 0 if result["error_count"] == 0 and result["lost_tokens"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
