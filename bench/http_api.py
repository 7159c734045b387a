"""What the OpenAI-compatible HTTP API costs against the gRPC API, per token.

Usage:
  python bench/http_api.py                      # the fetched real pair (torch, --dtype bfloat16)
  python bench/http_api.py --tiny               # a tiny random pair built here: the transport shows
  python bench/http_api.py --concurrency 1,16 --max-tokens 64 --repeats 3

One `specdec up` (coordinator, draft and target as processes, the HTTP API on a free port).
For each concurrency level, the same streaming chat requests (greedy, EOS ignored, adaptive
speculation) go through the official `openai` client (AsyncOpenAI, server-sent events) and
through the gRPC `Generate` stream, interleaved per repeat: tokens/s over all requests, and the
time between streamed chunks per token (median and p95 of the gaps, each gap divided by the
chunk's tokens). Greedy output must be the same over both (checked). Prints a table and writes
http.json to --out (default bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import free_port, model_pair  # noqa: E402
from specdec.rpc.health import wait_healthy  # noqa: E402
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

QUESTIONS = ["Write a Python function that reverses a linked list.",
             "Explain what a hash map is in two sentences.",
             "List three uses of binary search.",
             "Write a haiku about compilers."]


def timings(started: float, chunks: list[tuple[float, int]]) -> dict:
    """tokens, seconds, and the per-token gaps between streamed chunks after the first."""
    gaps = [(t - prev) / n for (prev, _), (t, n) in zip(chunks, chunks[1:]) if n > 0]
    return {"tokens": sum(n for _, n in chunks), "seconds": chunks[-1][0] - started if chunks else 0.0,
            "gaps": gaps}


async def one_http(client, model: str, question: str, max_tokens: int) -> tuple[str, dict]:
    started, chunks, text = time.perf_counter(), [], []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            chunks.append((time.perf_counter(), 0))
        if chunk.usage is not None and chunks:
            # usage counts the tokens; spread them over the content chunks for the gaps
            per = chunk.usage.completion_tokens / len(chunks)
            chunks = [(t, per) for t, _ in chunks]
    return "".join(text), timings(started, chunks)


async def one_grpc(stub, question: str, max_tokens: int) -> tuple[str, dict]:
    request = coordinator_pb2.GenerateRequest(max_new_tokens=max_tokens, ignore_eos=True,
                                              sampling=common_pb2.SamplingParams(temperature=0.0))
    request.messages.messages.append(coordinator_pb2.ChatMessage(role="user", content=question))
    started, chunks, text = time.perf_counter(), [], []
    async for chunk in stub.Generate(request, timeout=3600):
        if chunk.token_ids:
            text.append(chunk.text)
            chunks.append((time.perf_counter(), len(chunk.token_ids)))
    return "".join(text), timings(started, chunks)


def summary(results: list[dict], wall: float) -> dict:
    gaps = sorted(g for r in results for g in r["gaps"])
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
            "gap_ms_median": 1000 * statistics.median(gaps) if gaps else None,
            "gap_ms_p95": 1000 * gaps[int(0.95 * (len(gaps) - 1))] if gaps else None}


async def run_level(http_client, model: str, grpc_address: str, concurrency: int, max_tokens: int,
                    repeats: int) -> dict:
    out: dict = {"concurrency": concurrency, "http": [], "grpc": [], "same_text": True}
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(concurrency)]
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for _ in range(repeats):
            texts = {}
            for transport in ("http", "grpc"):  # interleaved: each repeat runs both
                t0 = time.perf_counter()
                if transport == "http":
                    done = await asyncio.gather(*(one_http(http_client, model, q, max_tokens) for q in questions))
                else:
                    done = await asyncio.gather(*(one_grpc(stub, q, max_tokens) for q in questions))
                out[transport].append(summary([d for _, d in done], time.perf_counter() - t0))
                texts[transport] = [t for t, _ in done]
            out["same_text"] &= texts["http"] == texts["grpc"]
    for transport in ("http", "grpc"):
        runs = out[transport]
        out[f"{transport}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
        out[f"{transport}_gap_ms_median"] = statistics.median(r["gap_ms_median"] for r in runs)
        out[f"{transport}_gap_ms_p95"] = statistics.median(r["gap_ms_p95"] for r in runs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random pair built here")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--target-model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,16", help="concurrent requests per level, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    import openai

    draft, target = model_pair(args, "bench/http_api.py")
    port, http_port = free_port(), free_port()
    for offset in (1, 2):
        if port + offset == http_port:
            http_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec_cli", "up", "--port", str(port), "--http-port",
                             str(http_port), "--dtype", args.dtype, "--draft-model", draft, "--target-model",
                             target], stdout=subprocess.DEVNULL, cwd=ROOT, env=os.environ.copy())
    try:
        wait_healthy(f"127.0.0.1:{port}", 900, [proc])
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused")
        model = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused").models.list().data[0].id

        async def all_levels() -> list[dict]:
            return [await run_level(client, model, f"127.0.0.1:{port}", int(level), args.max_tokens, args.repeats)
                    for level in args.concurrency.split(",")]

        levels = asyncio.run(all_levels())
    finally:
        proc.terminate()
        proc.wait(60)
    result = {"date": time.strftime("%Y-%m-%d"), "draft_model": draft, "target_model": target,
              "dtype": args.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats, "levels": levels}
    lines = ["concurrency  http tok/s  grpc tok/s  ratio  http gap ms (p50/p95)  grpc gap ms (p50/p95)  same text"]
    for lv in levels:
        lines.append(f"{lv['concurrency']:>11}  {lv['http_tokens_per_s']:>10.1f}  {lv['grpc_tokens_per_s']:>10.1f}  "
                     f"{lv['http_tokens_per_s'] / lv['grpc_tokens_per_s']:>5.2f}  "
                     f"{lv['http_gap_ms_median']:>9.2f} / {lv['http_gap_ms_p95']:<9.2f}  "
                     f"{lv['grpc_gap_ms_median']:>9.2f} / {lv['grpc_gap_ms_p95']:<9.2f}  {lv['same_text']}")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'http.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
