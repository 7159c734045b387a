"""llama.cpp's own server as a peer: the same GGUF files and prompts through `llama-server`.

`bench/speedup.py --llama-server PATH` starts it twice on loopback — plain decoding of the
target, and the target with the draft (`--spec-type draft-simple --model-draft`, llama.cpp's
draft-model speculation at its default settings) —
and times every prompt through both beside specdec's methods. A request is the prompt's token
ids (exactly what the coordinator feeds), greedy, EOS ignored, streamed, with the prompt cache
off; the decode rate is timed like every other method: tokens after the first streamed chunk
over the time after it.

llama-server comes from the llama.cpp source that llama-cpp-python's sdist ships
(`vendor/llama.cpp`), built with cmake: see docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import time
from typing import Callable, Iterator

from bench.hf_methods import Timed

PREFIX = "llama-server "
PLAIN = PREFIX + "plain"
WITH_DRAFT = PREFIX + "draft"
START_TIMEOUT = 300.0


def command(binary: str, model: str, port: int, threads: int, draft: str = "") -> list[str]:
    """The server's command line: one slot, our threads, the prompt's context, no web UI."""
    argv = [binary, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--threads-batch", str(threads), "--parallel", "1", "--ctx-size", "4096", "--no-webui"]
    if draft:
        argv += ["--spec-type", "draft-simple", "--model-draft", draft, "--threads-draft", str(threads),
                 "--threads-batch-draft", str(threads)]
    return argv


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = START_TIMEOUT) -> None:
    """Until GET /health answers 200 (the model loaded), or the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode} before it was ready")
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        with contextlib.suppress(OSError, http.client.HTTPException), contextlib.closing(connection):
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"llama-server was not ready within {timeout:.0f} s")


@contextlib.contextmanager
def serving(binary: str, model: str, port: int, threads: int, draft: str = "") -> Iterator[int]:
    """A running llama-server (its output discarded); stopped on exit."""
    proc = subprocess.Popen(command(binary, model, port, threads, draft), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def request_body(ids: list[int], new_tokens: int) -> dict:
    """A greedy, streamed /completion of exactly `new_tokens` tokens after the token ids."""
    return {"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "stream": True, "cache_prompt": False, "return_tokens": True}


def generate(port: int, ids: list[int], new_tokens: int) -> Timed:
    """One streamed generation, every server-sent event stamped as it arrives."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    timed = Timed([], time.perf_counter())
    connection.request("POST", "/completion", json.dumps(request_body(ids, new_tokens)),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
    for line in response:
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        tokens = event.get("tokens") or []
        if tokens:
            timed.chunks.append((time.perf_counter(), len(tokens)))
            timed.token_ids.extend(tokens)
        if event.get("stop"):
            break
    timed.ended = time.perf_counter()
    connection.close()
    return timed


@contextlib.contextmanager
def methods(binary: str, draft: str, target: str, port: int, threads: int) -> Iterator[dict[str, Callable]]:
    """name -> run(ids, new_tokens) -> Timed, for llama-server plain and with the draft, both
    running for the duration (so their runs interleave with the other methods')."""
    with serving(binary, target, port, threads) as plain, \
            serving(binary, target, port + 1, threads, draft) as drafted:
        yield {PLAIN: lambda ids, n: generate(plain, ids, n),
               WITH_DRAFT: lambda ids, n: generate(drafted, ids, n)}
