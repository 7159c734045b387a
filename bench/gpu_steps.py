"""The measurements of bench/gpu.py, each bounded by a Clock: the device's copy bandwidth, an
engine's decode step and verification curve on a cached history, HF `generate` in-process, and
specdec end to end through the real services (bench/speedup.py's and bench/concurrency.py's
helpers).

A Clock is cooperative: a measurement checks it before each repeat and stops early (saying so)
when the next repeat would not fit, so what was measured so far is kept.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from enum import StrEnum
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import torch

from bench import concurrency, report, speedup
from bench.hf_methods import generate as hf_generate
from specdec.v1 import coordinator_pb2

HF_PLAIN = "hf plain"  # report.py's name of HF generate, greedy, no assistant


class Engine(StrEnum):
    """The engines whose steps are measured in-process (--backends)."""

    TORCH = "torch"  # transformers' eager modules (specdec's TorchEngine)
    GRAPH = "graph"  # specdec/runtime/graph: static shapes, paged K/V, CUDA graphs where present


@dataclass
class Clock:
    """A step's time limit."""

    limit_s: float  # seconds the step may take
    started: float = field(default_factory=time.monotonic)  # monotonic start
    cut: list[str] = field(default_factory=list)  # what was left out for lack of time

    def left(self) -> float:
        return self.limit_s - (time.monotonic() - self.started)

    def fits(self, seconds: float, what: str) -> bool:
        """Whether `seconds` more fit; when not, `what` is recorded as left out."""
        if seconds <= self.left():
            return True
        self.cut.append(what)
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int, clock: Clock) -> dict:
    """Bytes read + written per second by a device-to-device copy of `nbytes` (median of repeats)."""
    n = nbytes // 2
    source = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dest = torch.empty_like(source)
    for _ in range(2):
        dest.copy_(source)
    sync(device)
    times = []
    for i in range(repeats):
        if times and not clock.fits(times[-1], f"copy repeats {i + 1}-{repeats}"):
            break
        start = time.perf_counter()
        dest.copy_(source)
        sync(device)
        times.append(time.perf_counter() - start)
    del source, dest
    seconds = statistics.median(times)
    return {"copy_GBps": 2 * n * 2 / seconds / 1e9, "bytes_copied": 2 * n, "median_s": seconds,
            "repeats": len(times)}


# ---- the engines, in-process ------------------------------------------------------------------

class EngineSession:
    """One session on an engine's SessionKV, the interface the services call: a decode step
    or a verification is `forward` on a session's cache entry, rollback its `crop`."""

    def __init__(self, name: str, engine: Any, details: dict):
        self.name = name  # an Engine
        self.engine = engine  # a specdec.runtime engine (its SessionKV half)
        self.details = details  # what the JSON reports about the engine (graphs captured ...)
        self.entry = None  # the session's cache entry once started

    @property
    def hf_model(self) -> Any:
        """The transformers model (the torch engine's; the graph engine consumed its own)."""
        return self.engine.model if self.name == Engine.TORCH else None

    def start(self, tokens: Sequence[int]) -> None:
        self.entry, feed = self.engine.begin("bench", 0, 0, list(tokens))
        self.engine.forward("bench", self.entry, feed, 1)

    def step(self, tokens: Sequence[int]) -> None:
        self.engine.forward("bench", self.entry, tokens, len(tokens))

    def rollback(self, length: int) -> None:
        self.entry.crop(length)

    def close(self) -> None:
        if hasattr(self.engine, "graph"):
            self.details.update(replays=self.engine.graph.replays, eager_runs=self.engine.graph.eager_runs)
        self.engine.release("bench")


def torch_engine(path: str, dtype: str, device: str) -> EngineSession:
    from specdec.config import TargetConfig
    from specdec.runtime.engines import engine_from_config

    engine = engine_from_config(TargetConfig(model=path, backend=Engine.TORCH.value, dtype=dtype, device=device,
                                             max_speculative_tokens=64, prefix_cache_bytes=0))
    return EngineSession(Engine.TORCH, engine, {})


def graph_engine(path: str, dtype: str, device: str, tokens: int) -> EngineSession:
    """The graph engine (the services' --backend graph) with the buckets one session
    needs: 1 session × 1..16 tokens over `tokens` of context, captured on CUDA (eager beyond them,
    and everywhere without CUDA)."""
    from specdec.runtime.graph.cuda_graphs import DECODE_AND_VERIFY_TOKENS, TREE_WINDOW, Buckets
    from specdec.runtime.graph.paged_kv import DEFAULT_BLOCK_SIZE
    from specdec.runtime.graph.engine import GraphEngine
    from specdec.runtime.loader import load_model

    blocks = -(-tokens // DEFAULT_BLOCK_SIZE)
    buckets = Buckets(rows=(1,), tokens=DECODE_AND_VERIFY_TOKENS, blocks=(blocks,), window=TREE_WINDOW)
    loaded = load_model(path, dtype, device)
    per_token = 2 * loaded.model.config.num_hidden_layers * loaded.model.config.num_key_value_heads * \
        (loaded.model.config.hidden_size // loaded.model.config.num_attention_heads) * loaded.dtype.itemsize
    engine = GraphEngine(loaded, 2, (blocks + 2) * DEFAULT_BLOCK_SIZE * per_token, 64,
                         block_size=DEFAULT_BLOCK_SIZE, buckets=buckets)
    start = time.perf_counter()
    graphs = engine.capture()
    return EngineSession(Engine.GRAPH, engine, {
        "graphs_captured": graphs, "capture_s": time.perf_counter() - start,
        "buckets": [[s.rows, s.tokens, s.blocks, s.window] for s in engine.graph.shapes]})


def open_engine(name: str, path: str, dtype: str, device: str, tokens: int) -> EngineSession:
    return torch_engine(path, dtype, device) if name == Engine.TORCH else graph_engine(path, dtype, device, tokens)


def curve(engine, device: torch.device, history: int, sizes: Sequence[int], repeats: int, high: int,
          clock: Clock) -> dict:
    """Milliseconds of one forward of k new tokens on a session holding `history` tokens, per
    k in sizes (median of the repeats; the sizes interleaved within each repeat, rolled back
    after each) -> {"ms": {k: ms}, "repeats": n}."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, high, (history + max(sizes),), generator=generator).tolist()
    engine.start(tokens[:history])
    times: dict[int, list[float]] = {k: [] for k in sizes}
    one_pass = 0.0
    for i in range(repeats + 1):  # the first pass warms up
        if i and not clock.fits(one_pass, f"curve repeats {i}-{repeats}"):
            break
        started = time.perf_counter()
        for k in sizes:
            sync(device)
            start = time.perf_counter()
            engine.step(tokens[history:history + k])
            sync(device)
            if i:
                times[k].append(time.perf_counter() - start)
            engine.rollback(history)
        one_pass = time.perf_counter() - started
    engine.close()
    if not times[sizes[0]]:
        raise TimeoutError("no time for one timed pass after the warm-up")
    return {"ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}, "repeats": len(times[sizes[0]])}


def hf_generate_rate(model: Any, ids: list[int], new_tokens: int, clock: Clock) -> dict:
    """transformers' eager `generate`, greedy, in-process: decode tokens/s (after a warm-up of 8
    tokens; fewer than new_tokens, at least 16, when the clock says so)."""
    start = time.perf_counter()
    hf_generate(model, ids, 8)
    per_token = (time.perf_counter() - start) / 8  # the prefill included: an overestimate
    fit = min(new_tokens, int(clock.left() / (1.25 * per_token)))
    if fit < 16:
        raise TimeoutError(f"a warm-up of 8 tokens took {8 * per_token:.1f} s: 16 tokens do not fit")
    if fit < new_tokens:
        clock.cut.append(f"hf generate of {new_tokens} tokens (ran {fit})")
    run = speedup.record([(hf_generate(model, ids, fit), None)])
    return {k: v for k, v in run.items() if k != "token_ids"} | {"token_ids": run["token_ids"]}


# ---- specdec through the services -------------------------------------------------------------

def draft_fields(gamma: int) -> dict:
    return {"proposer": coordinator_pb2.PROPOSER_DRAFT, "num_speculative_tokens": gamma}


def methods(gammas: Sequence[int]) -> dict[str, dict]:
    """name (bench/report.py's) -> the GenerateRequest fields of target-only, the fixed γs, auto."""
    out = {report.TARGET_ONLY: {"proposer": coordinator_pb2.PROPOSER_NONE}}
    out.update({f"{report.DRAFT_PREFIX}{g}": draft_fields(g) for g in gammas})
    out[report.AUTO] = {"proposer": coordinator_pb2.PROPOSER_AUTO}
    return out


@contextlib.contextmanager
def services(draft: str, target: str, options: SimpleNamespace, live: list) -> Iterator[subprocess.Popen]:
    """`specdec up` on draft and target (bench/speedup.py's start_services); `live` holds the
    process while it runs (for the watchdog)."""
    proc = speedup.start_services(draft, target, options)
    live.append(proc)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        live.remove(proc)


def specdec_runs(stub, ids: list[int], new_tokens: int, chosen: dict[str, dict], settle: int,
                 clock: Clock) -> dict[str, dict]:
    """Each method once on `ids` (after a short warm-up of each and `settle` auto runs), in
    bench/speedup.py's record format, until the clock runs out."""
    started = time.perf_counter()
    for fields in chosen.values():  # warm-up: caches, allocators, the coordinator's cost model
        speedup.run_specdec(stub, ids, min(16, new_tokens), fields)
    per_token = (time.perf_counter() - started) / (len(chosen) * min(16, new_tokens))  # prefills included
    for i in range(settle):
        if clock.fits(1.25 * per_token * new_tokens, f"settling run {i + 1}"):
            speedup.run_specdec(stub, ids, new_tokens, chosen[report.AUTO])
    runs = {}
    for name, fields in chosen.items():
        if not clock.fits(1.25 * per_token * new_tokens, name):
            continue
        start = time.perf_counter()
        runs[name] = speedup.record([speedup.run_specdec(stub, ids, new_tokens, fields)])
        per_token = max(per_token, (time.perf_counter() - start) / new_tokens)
    return runs


def concurrency_levels(address: str, levels: Sequence[int], new_tokens: int, proc: subprocess.Popen,
                       clock: Clock) -> list[dict]:
    """Target-only (γ = 0) at each number of concurrent sessions (bench/concurrency.py's level):
    aggregate tokens/s and its multiple of one session's."""
    start = time.perf_counter()
    concurrency.level(address, 2, 0, 8, proc)  # warm-up
    rate = 16 / (time.perf_counter() - start)  # aggregate tokens/s so far
    rows = []
    for sessions in levels:
        # a level of more sessions is faster in aggregate, at most (we assume) twice the last one's
        if not clock.fits(sessions * new_tokens / (2 * rate), f"{sessions} sessions"):
            continue
        row = concurrency.level(address, sessions, 0, new_tokens, proc)
        rate = row["tokens_per_second"]
        rows.append({k: v for k, v in row.items() if k != "gamma"})
    one = next((r for r in rows if r["sessions"] == 1), None)
    for row in rows:
        row["x_one_session"] = row["tokens_per_second"] / one["tokens_per_second"] if one else None
    return rows


def with_analysis(runs: dict[str, dict]) -> dict:
    """bench/report.py's analysis of one prompt's runs (speed-ups over target-only, α, c, the
    bound), the token ids dropped once compared."""
    summary = report.analyse_prompt(runs) if report.TARGET_ONLY in runs else {}
    return {"runs": {m: {k: v for k, v in r.items() if k != "token_ids"} for m, r in runs.items()},
            "summary": summary}

