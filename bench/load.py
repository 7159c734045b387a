"""Open-loop load test: Poisson arrivals at rising rates through the OpenAI-compatible HTTP API.

Usage:
  python bench/load.py                                   # `specdec up` on the fetched pair (llama.cpp)
  python bench/load.py --rates 0.1,0.2,0.5,1,2 --duration 60 --seed 0
  python bench/load.py --tiny --rates 1,4 --requests 8   # a tiny random pair built here: a smoke run
  python bench/load.py --base-url http://HOST:8000       # a coordinator already running

As serving benchmarks measure it (vLLM's `benchmark_serving`): for each rate in --rates, requests
arrive as a Poisson process (exponential gaps, seeded) for --duration seconds (or --requests of
them), each sent when its time comes whatever the earlier ones are doing (open loop), through
the official `openai` client (AsyncOpenAI, streaming chat completions, no client retries). Each
request is one of the bench prompts (bench/prompts.py) with an output length drawn uniformly
from --min-tokens..--max-tokens, EOS ignored so it generates exactly that many, greedy. A rate
ends when its last request has ended (each bounded by --request-timeout).

Per rate: completed requests/s and output tokens/s over the rate's wall time, time to first
token (TTFT) and time per output token after it (TPOT, vLLM's (latency − TTFT) / (tokens − 1)),
p50 and p99 of the completed requests; the share refused with 429 and whether each refusal
carried Retry-After; other errors (count and first messages); client timeouts; streams cut short.
The saturation rate is the lowest rate whose p99 TPOT is twice the lowest rate's or more. Past
it a server that refuses cleanly answers 429 with Retry-After and loses nothing (no other error,
no timeout, no stream cut short) while its admitted requests' latency stays bounded; the verdict
in the JSON says whether this run showed that. The machine's load averages are recorded before
and after each rate (other work may share it). Prints a table; writes load.json, load.txt and
load.png to --out (default bench/results/).

Without --base-url it starts `specdec up` itself (the fetched pair as the quick start serves it,
or --draft-model/--target-model, or --tiny) on free ports, with --max-concurrent-generations
passed to its coordinator when given, and stops it at the end; its log goes to
load-services.log in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load_report import (Outcome, RequestResult, plot, saturation_rate, summarise_rate,  # noqa: E402
                               table, verdict)
from bench.processes import free_port  # noqa: E402
from bench.prompts import PROMPTS, Prompt  # noqa: E402

WARMUP_TOKENS = 16  # output tokens of each warm-up request


@dataclass(frozen=True)
class Planned:
    """One request of a rate's schedule."""

    at_s: float  # when it is sent, seconds after the rate's first request
    prompt: Prompt  # what it asks
    max_tokens: int  # how many tokens it asks for


def parse_rates(text: str) -> list[float]:
    """'0.1,0.5,2' -> [0.1, 0.5, 2.0], ascending without repeats; ValueError on anything else
    than positive finite numbers."""
    rates = [float(part) for part in text.split(",")]
    if not rates or any(not (0 < rate < float("inf")) for rate in rates):
        raise ValueError(f"rates must be positive numbers, got {text!r}")
    return sorted(set(rates))


def schedule(seed: int, rate: float, requests: int, duration_s: float, prompts: tuple[Prompt, ...],
             min_tokens: int, max_tokens: int) -> list[Planned]:
    """A rate's requests: the first at 0, then exponential gaps of mean 1/rate (a Poisson
    process), `requests` of them, or (requests 0) every one that arrives before duration_s.
    Prompts and lengths drawn uniformly; the same seed and rate give the same schedule."""
    rng = random.Random(f"{seed}:{rate}")
    out: list[Planned] = []
    at = 0.0
    while (len(out) < requests) if requests else (at < duration_s):
        out.append(Planned(at, rng.choice(prompts), rng.randint(min_tokens, max_tokens)))
        at += rng.expovariate(rate)
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


async def one_request(client, model: str, planned: Planned, arrival_s: float, timeout_s: float) -> RequestResult:
    """Send one streaming chat completion and time it; every ending becomes an Outcome."""
    import openai

    result = RequestResult(arrival_s, planned.prompt.name, planned.max_tokens)
    started = time.perf_counter()
    finish, text_chunks, usage_tokens = None, 0, None
    try:
        async with asyncio.timeout(timeout_s):
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": role, "content": content} for role, content in planned.prompt.messages],
                max_tokens=planned.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            try:
                async for chunk in stream:
                    for choice in chunk.choices:
                        if choice.delta and choice.delta.content:
                            if result.ttft_s is None:
                                result.ttft_s = time.perf_counter() - started
                            text_chunks += 1
                        finish = choice.finish_reason or finish
                    if chunk.usage is not None:
                        usage_tokens = chunk.usage.completion_tokens
            finally:
                await stream.close()
        result.latency_s = time.perf_counter() - started
        result.output_tokens = usage_tokens if usage_tokens is not None else text_chunks
        complete = finish is not None and result.output_tokens >= planned.max_tokens
        result.outcome = Outcome.COMPLETED if complete else Outcome.INCOMPLETE
        if not complete:
            result.message = f"finish_reason {finish}, {result.output_tokens} of {planned.max_tokens} tokens"
    except (TimeoutError, openai.APITimeoutError):
        result.outcome, result.message = Outcome.TIMEOUT, f"not finished within {timeout_s:g} s"
    except openai.RateLimitError as exc:
        result.outcome, result.status = Outcome.REFUSED, exc.status_code
        result.retry_after, result.message = exc.response.headers.get("retry-after"), first_line(exc)
    except openai.APIStatusError as exc:
        result.outcome, result.status, result.message = Outcome.ERROR, exc.status_code, first_line(exc)
    except Exception as exc:  # noqa: BLE001 — a connection reset, an error event mid-stream: all counted
        result.outcome, result.message = Outcome.ERROR, first_line(exc)
    return result


async def run_rate(client, model: str, plan: list[Planned], timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send the plan open-loop; (results in arrival order, wall seconds from the first arrival to
    the end of the last request)."""
    started = time.perf_counter()
    tasks = []
    for planned in plan:
        delay = started + planned.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(
            one_request(client, model, planned, time.perf_counter() - started, timeout_s)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages (what `uptime` prints)."""
    return [round(value, 2) for value in os.getloadavg()]


def machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average_at_start": load_average()}


async def run_all(args, base_url: str) -> tuple[str, list[dict]]:
    """Warm up, then every rate in turn; (the served model, the rows)."""
    import openai

    rows: list[dict] = []
    prompts = chosen_prompts(args.prompts)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=args.api_key, max_retries=0,
                                  timeout=args.request_timeout) as client:
        model = (await client.models.list()).data[0].id
        for _ in range(args.warmup):  # caches, allocators, the cost model: not measured
            warm = await one_request(client, model, Planned(0.0, prompts[0], WARMUP_TOKENS), 0.0, args.request_timeout)
            if warm.outcome is not Outcome.COMPLETED:
                raise SystemExit(f"bench/load.py: the warm-up request failed: {warm.outcome.value} {warm.message}")
        for rate in parse_rates(args.rates):
            plan = schedule(args.seed, rate, args.requests, args.duration, prompts, args.min_tokens, args.max_tokens)
            before = load_average()
            results, wall = await run_rate(client, model, plan, args.request_timeout)
            row = summarise_rate(rate, results, wall)
            row.update(load_average_before=before, load_average_after=load_average(),
                       requests=[r.as_dict() for r in results])
            rows.append(row)
            print(f"rate {rate:g}/s: {row['sent']} sent, {row['completed']} completed, {row['refused']} refused, "
                  f"{row['errors']} errors, {row['timeouts']} timeouts, p99 TPOT {row['tpot_ms']['p99']} ms, "
                  f"load {row['load_average_after'][0]}", flush=True)
            await asyncio.sleep(args.cooldown)
    return model, rows


def chosen_prompts(names: str) -> tuple[Prompt, ...]:
    if not names:
        return PROMPTS
    by_name = {p.name: p for p in PROMPTS}
    unknown = [name for name in names.split(",") if name not in by_name]
    if unknown:
        raise SystemExit(f"bench/load.py: no prompt {', '.join(unknown)}; the suite has {', '.join(by_name)}")
    return tuple(by_name[name] for name in names.split(","))


def start_services(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`specdec up` on free ports; (the process, the HTTP API's base URL) once it is healthy."""
    from specdec.rpc.health import wait_healthy

    port = free_port()
    http_port = free_port()
    while http_port in (port, port + 1, port + 2):
        http_port = free_port()
    command = [sys.executable, "-m", "specdec_cli", "up", "--port", str(port), "--http-port", str(http_port),
               "--backend", args.backend]
    draft, target = args.draft_model, args.target_model
    if args.tiny:
        from specdec_cli.tiny import build_pair

        draft, target = map(str, build_pair(Path(tempfile.mkdtemp(prefix="specdec-load-")), "llama", context=4096))
    if draft and target:
        command += ["--draft-model", draft, "--target-model", target]
    if args.dtype:
        command += ["--dtype", args.dtype]
    env = dict(os.environ)
    if args.max_concurrent_generations:
        env["SPECDEC_COORDINATOR_MAX_CONCURRENT_GENERATIONS"] = str(args.max_concurrent_generations)
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_healthy(f"127.0.0.1:{port}", 900, [proc])
    except BaseException:
        stop(proc)
        raise SystemExit(f"bench/load.py: `specdec up` did not come up; see {log_path}")
    return proc, f"http://127.0.0.1:{http_port}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="", help="a running coordinator's HTTP API (http://HOST:PORT); "
                   "default: start `specdec up` here")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"),
                   help="the coordinator's API key, if it has one (env OPENAI_API_KEY)")
    p.add_argument("--rates", default="0.1,0.2,0.5,1,2", help="offered requests per second, comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--requests", type=int, default=0, help="requests per rate instead of --duration (0 = use it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals, prompts and lengths")
    p.add_argument("--min-tokens", type=int, default=32, help="shortest output length drawn")
    p.add_argument("--max-tokens", type=int, default=96, help="longest output length drawn")
    p.add_argument("--prompts", default="", help="comma-separated bench prompt names (default: all ten)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds a request may take before the client gives up (counted as a timeout)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent one by one before the first rate")
    p.add_argument("--cooldown", type=float, default=2.0, help="seconds of rest between rates")
    p.add_argument("--tiny", action="store_true", help="start the services on a tiny random pair built here")
    p.add_argument("--draft-model", default="", help="the draft to start (default: the fetched pair)")
    p.add_argument("--target-model", default="", help="the target to start (default: the fetched pair)")
    p.add_argument("--backend", default="auto", help="`specdec up --backend` (auto: llama.cpp on the fetched GGUF)")
    p.add_argument("--dtype", default="", help="`specdec up --dtype` (default: its own)")
    p.add_argument("--max-concurrent-generations", type=int, default=0,
                   help="the started coordinator's --max-concurrent-generations (0 = its default)")
    p.add_argument("--no-plot", action="store_true", help="write no load.png")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 1 <= args.min_tokens <= args.max_tokens:
        raise SystemExit("bench/load.py: need 1 <= --min-tokens <= --max-tokens")
    try:
        parse_rates(args.rates)
    except ValueError as exc:
        raise SystemExit(f"bench/load.py: --rates: {exc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = machine()
    proc, base_url = (None, args.base_url.rstrip("/")) if args.base_url else start_services(
        args, out / "load-services.log")
    try:
        model, rows = asyncio.run(run_all(args, base_url))
    finally:
        if proc is not None:
            stop(proc)
    saturation = saturation_rate(rows)
    document = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", "bench/load.py", *sys.argv[1:]])
                if argv is None else " ".join(["python", "bench/load.py", *argv]),
                "machine": {**host, "load_average_at_end": load_average()},
                "base_url": args.base_url or "started here", "model": model,
                "settings": {k: v for k, v in vars(args).items() if k not in ("api_key", "out")},
                "saturation_rate": saturation, "verdict": verdict(rows, saturation), "rates": rows}
    text = table(rows, saturation)
    print(text)
    print(json.dumps(document["verdict"], indent=2))
    (out / "load.json").write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    (out / "load.txt").write_text(text + "\n" + json.dumps(document["verdict"], indent=2) + "\n")
    title = f"{model}: open-loop Poisson load, {args.min_tokens}-{args.max_tokens} output tokens, {document['date']}"
    written = [out / "load.json", out / "load.txt"]
    if not args.no_plot:
        if plot(rows, saturation, out / "load.png", title):
            written.append(out / "load.png")
        else:
            print("matplotlib not installed: no plot (pip install -e '.[bench]')")
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
