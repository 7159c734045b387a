"""K/V chunks: what restoring a session's K/V saves against re-prefilling it.

Usage:
  python bench/kv_restore.py                         # the fetched real pair (torch, --dtype bfloat16)
  python bench/kv_restore.py --tiny                  # a tiny random pair built here (a smoke run)
  python bench/kv_restore.py --lengths 1024,2048,4096 --sessions 16 --shared-prefix 1500

A redis-server of its own on a free loopback port (the draft's chunks in DB 1, the target's in
DB 2, the sessions in DB 0); the services as processes (`specdec serve draft|target|coordinator`).

(a) Moved sessions. Per length L: a session with an L-token prompt is created on one deployment
    (draft, target and coordinator with --kv-store), which then goes away; the session is
    continued (one new token, 8 new tokens) on fresh draft, target and coordinator processes,
    once with the KV store (they restore its chunks) and once without (they re-prefill). Every
    request is greedy and calls the draft (proposer draft, γ = 1), so both tiers need the
    history before the first token. Time to first token of each, and the tokens restored.
(b) Shared prefix. --sessions new sessions whose prompts share a --shared-prefix-token prefix
    (then 32 tokens of their own) on one deployment with the prefix cache (--prefix-cache-bytes,
    no KV store) and one without: total time to first token and the target's restored tokens.
(c) Stored bytes. Per model, the bytes its chunks take in Redis (STRLEN of every value) per
    token stored, against the model's theoretical K/V size per token.
(d) Read speed. Per length, the MB/s at which the target's chunks (its geometry and --dtype,
    --chunk-tokens) are read from this Redis into a K/V buffer: the restore path against the
    MGET path before it (bench/kv_read.py; --read-reps rounds, 0 = skip (d)).

Prints a table, writes kv_restore.json and kv_restore.png to --out (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kv_memory import DTYPE_BYTES, kv_geometry, theoretical_bytes_per_token  # noqa: E402
from bench.processes import free_port, model_pair  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

NEW_TOKENS = 8
OWN_TOKENS = 32  # (b): each session's own tokens after the shared prefix


@contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench/kv_restore.py: redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(directory)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


class Deployment:
    """Draft, target and coordinator processes on free ports."""

    def __init__(self, draft: str, target: str, args, redis_url: str, kv_store: bool, prefix_cache_bytes: int):
        self.procs: list[subprocess.Popen] = []
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}
        serve = [sys.executable, "-m", "specdec_cli", "serve"]
        ports = {name: free_port() for name in ("draft", "target", "coordinator")}
        for name, model, db in (("draft", draft, 1), ("target", target, 2)):
            command = serve + [name, "--model", model, "--dtype", args.dtype, "--port", str(ports[name]),
                               "--kv-chunk-tokens", str(args.chunk_tokens),
                               "--prefix-cache-bytes", str(prefix_cache_bytes)]
            if name == "draft":
                command += ["--quantize", "none"]
            if kv_store:
                command += ["--kv-store", f"{redis_url}/{db}"]
            if args.threads:
                command += ["--threads", str(args.threads)]
            self.procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL))
        for name in ("draft", "target"):
            wait_healthy(f"127.0.0.1:{ports[name]}", 900, self.procs)
        self.procs.append(subprocess.Popen(
            serve + ["coordinator", "--draft", f"127.0.0.1:{ports['draft']}", "--target",
                     f"127.0.0.1:{ports['target']}", "--port", str(ports["coordinator"]),
                     "--session-store", f"{redis_url}/0", "--max-prompt-tokens", str(args.max_prompt_tokens),
                     # a draft prefilling thousands of tokens must not be cut off (its round would
                     # go target-only and the draft hold no history to keep)
                     "--draft-timeout-s", "3600"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL))
        self.address = f"127.0.0.1:{ports['coordinator']}"
        wait_healthy(self.address, 300, self.procs)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def generate(self, token_ids: list[int], session_id: str = "", max_new_tokens: int = NEW_TOKENS) -> dict:
        """One greedy request whose rounds call the draft (γ = 1), so both tiers hold and need the
        history: its time to first token, its stats and session id."""
        request = coordinator_pb2.GenerateRequest(session_id=session_id, max_new_tokens=max_new_tokens,
                                                  ignore_eos=True, proposer=coordinator_pb2.PROPOSER_DRAFT,
                                                  num_speculative_tokens=1,
                                                  sampling=common_pb2.SamplingParams(temperature=0.0))
        request.token_ids.ids.extend(token_ids)
        started, first, last = time.perf_counter(), None, None
        for chunk in self.stub.Generate(request, timeout=3600):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - started
            last = chunk
        return {"ttft_s": first, "session_id": last.session_id,
                "target_prefill_tokens": last.stats.target_prefill_tokens,
                "target_restored_tokens": last.stats.target_restored_tokens,
                "draft_restored_tokens": last.stats.draft_restored_tokens}

    def close(self) -> None:
        self.channel.close()
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextmanager
def deployment(*args, **kwargs) -> Iterator[Deployment]:
    d = Deployment(*args, **kwargs)
    try:
        yield d
    finally:
        d.close()


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def moved_sessions(draft: str, target: str, args, url: str, vocab: int) -> list[dict]:
    rows = []
    for length in args.lengths:
        prompt = token_ids(length, vocab, seed=length)
        with deployment(draft, target, args, url, kv_store=True, prefix_cache_bytes=0) as first:
            created = first.generate(prompt, max_new_tokens=2)  # a draft round: both tiers hold it
        row = {"tokens": length, "first_ttft_s": created["ttft_s"]}
        for label, store in (("store", True), ("prefill", False)):
            with deployment(draft, target, args, url, kv_store=store, prefix_cache_bytes=0) as fresh:
                result = fresh.generate([prompt[-1]], session_id=created["session_id"])
            row[f"{label}_ttft_s"] = result["ttft_s"]
            row[f"{label}_target_restored"] = result["target_restored_tokens"]
            row[f"{label}_draft_restored"] = result["draft_restored_tokens"]
        row["speedup"] = row["prefill_ttft_s"] / row["store_ttft_s"]
        rows.append(row)
        print(f"moved {length:>5} tokens: ttft {row['store_ttft_s']:.2f} s with the store, "
              f"{row['prefill_ttft_s']:.2f} s re-prefilling ({row['speedup']:.1f}x)", flush=True)
    return rows


def shared_prefix(draft: str, target: str, args, url: str, vocab: int) -> dict:
    prefix = token_ids(args.shared_prefix, vocab, seed=1)
    out = {"sessions": args.sessions, "prefix_tokens": args.shared_prefix}
    for label, cache in (("prefix_cache", args.prefix_cache_bytes), ("no_cache", 0)):
        with deployment(draft, target, args, url, kv_store=False, prefix_cache_bytes=cache) as d:
            results = [d.generate(prefix + token_ids(OWN_TOKENS, vocab, seed=100 + i), max_new_tokens=1)
                       for i in range(args.sessions)]
        out[f"{label}_ttft_total_s"] = sum(r["ttft_s"] for r in results)
        out[f"{label}_target_restored"] = sum(r["target_restored_tokens"] for r in results)
    out["speedup"] = out["no_cache_ttft_total_s"] / out["prefix_cache_ttft_total_s"]
    print(f"{args.sessions} sessions sharing {args.shared_prefix} tokens: "
          f"{out['prefix_cache_ttft_total_s']:.1f} s with the prefix cache, "
          f"{out['no_cache_ttft_total_s']:.1f} s without ({out['speedup']:.1f}x)", flush=True)
    return out


def stored_bytes(url: str, models: dict[str, str], args, chunk_tokens: int) -> dict:
    from transformers import AutoConfig

    out = {}
    for db, (role, model) in enumerate(models.items(), start=1):
        client = redis.Redis.from_url(f"{url}/{db}")
        keys = list(client.scan_iter("specdec:kv:*"))
        total = sum(client.strlen(k) for k in keys)
        geometry = kv_geometry(AutoConfig.from_pretrained(model))
        theory = theoretical_bytes_per_token(**geometry, dtype_bytes=DTYPE_BYTES[args.dtype])
        tokens = len(keys) * chunk_tokens
        out[role] = {"chunks": len(keys), "bytes": total, "bytes_per_token": total / tokens if tokens else None,
                     "theoretical_bytes_per_token": theory,
                     "ratio": total / tokens / theory if tokens else None}
    return out


def read_speed(target: str, args, url: str) -> list[dict]:
    """(d): the target's chunks read from this Redis, per length (bench/kv_read.py)."""
    import torch
    from transformers import AutoConfig

    from bench.kv_read import measure
    from specdec.kv.chunks import ChunkLayout

    geometry = kv_geometry(AutoConfig.from_pretrained(target))
    dtype = getattr(torch, args.dtype)
    return measure(f"{url}/3", lambda size: ChunkLayout(**geometry, dtype=dtype, tokens=size),
                   args.lengths, [args.chunk_tokens], args.read_reps)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["moved"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["prefill_ttft_s"] for r in rows], 0.4, label="re-prefill")
    ax.bar([x + 0.2 for x in xs], [r["store_ttft_s"] for r in rows], 0.4, label="KV store")
    ax.set_xticks(list(xs), [f"{r['tokens']} tokens" for r in rows])
    ax.set_ylabel("time to first token on fresh replicas (s)")
    ax.set_title("a session moved to fresh draft and target replicas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random pair built here")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPE_BYTES))
    parser.add_argument("--threads", type=int, default=0, help="threads of each service (0 = their default)")
    parser.add_argument("--lengths", default="1024,4096,16384", help="(a), (d): prompt lengths, comma-separated")
    parser.add_argument("--sessions", type=int, default=16, help="(b): sessions sharing the prefix (0 = skip (b))")
    parser.add_argument("--shared-prefix", type=int, default=1500, help="(b): tokens of the shared prefix")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="--kv-chunk-tokens of both services")
    parser.add_argument("--prefix-cache-bytes", type=int, default=1 << 30, help="(b): the services' prefix cache")
    parser.add_argument("--read-reps", type=int, default=3, help="(d): rounds per length (0 = skip (d))")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.max_prompt_tokens = max(args.lengths + [args.shared_prefix + OWN_TOKENS]) + 16
    draft, target = model_pair(args, "bench/kv_restore.py", context=max(args.lengths) + 256, layers=4, width=64)
    from transformers import AutoConfig

    vocab = min(AutoConfig.from_pretrained(m).vocab_size for m in (draft, target))
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as url:
        result = {"date": time.strftime("%Y-%m-%d"), "draft_model": draft, "target_model": target,
                  "dtype": args.dtype, "threads": args.threads, "chunk_tokens": args.chunk_tokens,
                  "moved": moved_sessions(draft, target, args, url, vocab)}
        result["stored"] = stored_bytes(url, {"draft": draft, "target": target}, args, args.chunk_tokens)
        if args.sessions > 0:
            result["shared_prefix"] = shared_prefix(draft, target, args, url, vocab)
        if args.read_reps > 0:
            result["read"] = read_speed(target, args, url)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["tokens  ttft store (s)  ttft re-prefill (s)  speed-up  target restored"]
    for r in result["moved"]:
        lines.append(f"{r['tokens']:>6}  {r['store_ttft_s']:>14.2f}  {r['prefill_ttft_s']:>19.2f}  "
                     f"{r['speedup']:>7.1f}x  {r['store_target_restored']:>15}")
    s = result.get("shared_prefix")
    if s:
        lines.append(f"{s['sessions']} sessions sharing {s['prefix_tokens']} tokens: total ttft "
                     f"{s['prefix_cache_ttft_total_s']:.1f} s with the prefix cache (target restored "
                     f"{s['prefix_cache_target_restored']} tokens), {s['no_cache_ttft_total_s']:.1f} s "
                     f"without ({s['speedup']:.1f}x)")
    for role, st in result["stored"].items():
        if st["bytes_per_token"]:
            lines.append(f"{role}: {st['chunks']} chunks, {st['bytes_per_token']:.0f} bytes/token stored, "
                         f"theory {st['theoretical_bytes_per_token']} ({st['ratio']:.4f}x)")
    for r in result["moved"]:
        lines.append(f"{r['tokens']} tokens: draft restored {r['store_draft_restored']} with the store")
    if result.get("read"):
        from bench.kv_read import table

        lines.append(table(result["read"]))
    print("\n".join(lines))
    (out / "kv_restore.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "kv_restore.png")
    print(f"wrote {out / 'kv_restore.json'}, {out / 'kv_restore.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
