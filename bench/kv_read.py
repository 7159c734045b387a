"""K/V restore read speed: MB/s from a loopback Redis into a session's K/V buffer.

Usage:
  python bench/kv_read.py                                  # the 1.5B target's geometry, bf16
  python bench/kv_read.py --lengths 1024,4096,16384 --chunk-tokens 64,128,256,512,1024 --reps 5

A redis-server of its own on a free loopback port. Per session length and chunk size, the
chunks of a session of the real pair's target (28 layers × K,V × 2 K/V heads × 128 dims,
bfloat16 unless --layers/--kv-heads/--head-dim/--dtype say otherwise) are written once, then
read back into a pre-touched [layers, 2, kv_heads, tokens, head_dim] buffer --reps times by two
paths, taken in turn so that both see the same load:

  mget    the path before issue 47: one MGET (redis-py's parser), decode_chunk (a copy into
          fresh memory) per chunk, then a copy into the buffer
  stream  the restore path: one pipeline of GETs read by a reader thread into two reused
          staging buffers (KVTier's), chunk_view (no copy), a copy into the buffer

and `read`: the stream path's reading alone. The median of the reps, in MB/s of stored bytes.
The machine's load average is recorded: on a shared machine the figures move with it.
Prints a table, writes kv_read.json to --out (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.kv.chunk_store import RedisChunkStore  # noqa: E402
from specdec.kv.chunks import HEADER_BYTES, ChunkLayout, chunk_keys, chunk_view, decode_chunk, encode_chunk  # noqa: E402
from specdec.runtime.kv_tier import staging_buffers  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def write_session(store: RedisChunkStore, layout: ChunkLayout, tokens: int, seed: int) -> list[bytes]:
    """The keys of a `tokens`-token session's chunks, written to the store."""
    keys = chunk_keys(seed.to_bytes(32, "little"), list(range(tokens)), layout.tokens)
    gen = torch.Generator().manual_seed(seed)
    for key in keys:  # one at a time: a 16k-token session is ~470 MB of values
        chunk = torch.randn(layout.shape, generator=gen).to(layout.dtype)
        store.put_many([(key, encode_chunk(chunk, key))])
    return keys


def read_mget(client: redis.Redis, store: RedisChunkStore, keys: list[bytes], layout: ChunkLayout,
              cache: torch.Tensor) -> int:
    """The path before: one MGET, a decoded copy per chunk, a copy into `cache`."""
    at = 0
    for key, value in zip(keys, client.mget([store._name(k) for k in keys])):
        chunk = decode_chunk(value, key, layout)  # [layers, 2, kv_heads, n, head_dim], fresh memory
        cache[:, :, :, at:at + layout.tokens].copy_(chunk)
        at += layout.tokens
    return at


def read_stream(store: RedisChunkStore, keys: list[bytes], layout: ChunkLayout, cache: torch.Tensor,
                staging: list[memoryview]) -> int:
    """The restore path: pipelined GETs into the staging buffers, viewed, copied into `cache`."""
    at = 0
    for key, value in zip(keys, store.stream(keys, staging)):
        chunk = chunk_view(value, key, layout)  # a view of a staging buffer
        cache[:, :, :, at:at + layout.tokens].copy_(chunk)
        at += layout.tokens
    return at


def read_only(store: RedisChunkStore, keys: list[bytes], staging: list[memoryview]) -> int:
    return sum(1 for value in store.stream(keys, staging) if value is not None)


def measure(url: str, layout_of, lengths: list[int], chunk_sizes: list[int], reps: int) -> list[dict]:
    """One row per (length, chunk size): median MB/s of each path over `reps` rounds."""
    rows = []
    client = redis.Redis.from_url(url)
    with RedisChunkStore(url, ttl_s=3600, namespace="bench:kv:") as store:
        for tokens in lengths:
            for size in chunk_sizes:
                layout = layout_of(size)
                keys = write_session(store, layout, tokens - tokens % size, seed=tokens * 7919 + size)
                nbytes = len(keys) * (HEADER_BYTES + layout.nbytes)
                cache = torch.ones(layout.shape[:3] + (tokens, layout.shape[4]), dtype=layout.dtype)  # touched
                staging = staging_buffers(layout, torch.device("cpu"))
                seconds: dict[str, list[float]] = {"mget": [], "stream": [], "read": []}
                for _ in range(reps):
                    for name, run in (("mget", lambda: read_mget(client, store, keys, layout, cache)),
                                      ("stream", lambda: read_stream(store, keys, layout, cache, staging)),
                                      ("read", lambda: read_only(store, keys, staging))):
                        started = time.perf_counter()
                        run()
                        seconds[name].append(time.perf_counter() - started)
                row = {"tokens": tokens, "chunk_tokens": size, "chunks": len(keys), "bytes": nbytes,
                       "load_average": os.getloadavg()[0]}
                for name, times in seconds.items():
                    row[f"{name}_s"] = statistics.median(times)
                    row[f"{name}_mb_s"] = nbytes / statistics.median(times) / 1e6
                rows.append(row)
                print(f"{tokens:>6} tokens, {size:>4}-token chunks: mget {row['mget_mb_s']:6.0f} MB/s, "
                      f"stream {row['stream_mb_s']:6.0f} MB/s, read alone {row['read_mb_s']:6.0f} MB/s "
                      f"(load {row['load_average']:.1f})", flush=True)
                client.delete(*[store._name(k) for k in keys])
    client.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["tokens  chunk  MB    mget MB/s  stream MB/s  read MB/s  stream s  speed-up  load"]
    for r in rows:
        lines.append(f"{r['tokens']:>6}  {r['chunk_tokens']:>5}  {r['bytes'] / 1e6:>4.0f}  {r['mget_mb_s']:>9.0f}  "
                     f"{r['stream_mb_s']:>11.0f}  {r['read_mb_s']:>9.0f}  {r['stream_s']:>8.3f}  "
                     f"{r['mget_s'] / r['stream_s']:>7.1f}x  {r['load_average']:>4.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096,16384", help="session lengths in tokens")
    parser.add_argument("--chunk-tokens", default="64,256,1024", help="chunk sizes to compare")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the copies")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    sizes = [int(n) for n in args.chunk_tokens.split(",")]

    def layout_of(size: int) -> ChunkLayout:
        return ChunkLayout(args.layers, args.kv_heads, args.head_dim, DTYPES[args.dtype], size)

    from bench.kv_restore import redis_server

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as url:
        rows = measure(url, layout_of, lengths, sizes, args.reps)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "geometry": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                           "dtype": args.dtype}, "reps": args.reps, "threads": args.threads, "rows": rows}
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_read.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'kv_read.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
