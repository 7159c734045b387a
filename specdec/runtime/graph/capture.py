"""Capturing CUDA graphs: one bucket at a time, a failure costing only that bucket.

What this module decides:
- `cuda_graph` captures one callable: two warm-up runs on a side stream (lazy initialisations
  happen off the capture), then the capture into the engine's shared memory pool. The callable
  writes into static outputs it closes over, so a replay leaves its results there.
- `capturing(device)` is the context every capture runs in: the model's CUDA device made current
  (a service on cuda:1 would otherwise capture on cuda:0's stream) and Python's garbage collector
  frozen and off (torch runs `gc.collect()` at every capture in some versions: 175 ms a graph
  with a full heap, minutes over hundreds of graphs).
- `capture_each` captures every bucket, largest first; a bucket that fails (out of memory, an
  operation capture refuses) is logged at WARNING with its shape and runs eagerly; the others
  are kept. Capture is a speed-up only: an eager bucket computes the same logits.
- `eager_graph` is the stand-in a CPU uses to run the same capture path without CUDA (the tests
  do): it runs the callable once at "capture" and again at every replay.
- `capture_setting` reads --cuda-graphs (auto, on, off) and SPECDEC_CUDA_GRAPHS, which overrides
  auto in every service of the process tree (off: no capture anywhere, e.g. to rule graphs out).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator, Protocol

import torch

from specdec.types import CudaGraphs

log = logging.getLogger(__name__)

CUDA_GRAPHS_ENV = "SPECDEC_CUDA_GRAPHS"  # auto | on | off: overrides --cuda-graphs auto


def capture_setting(setting: str, environ: dict | None = None) -> bool | None:
    """--cuda-graphs as CudaGraphRunner's `capture`: True, False, or None (capture on CUDA only);
    SPECDEC_CUDA_GRAPHS decides where the flag says auto."""
    environ = os.environ if environ is None else environ
    choice = CudaGraphs(setting or CudaGraphs.AUTO)
    if choice == CudaGraphs.AUTO:
        choice = CudaGraphs(environ.get(CUDA_GRAPHS_ENV, "").strip().lower() or CudaGraphs.AUTO)
    return {CudaGraphs.AUTO: None, CudaGraphs.ON: True, CudaGraphs.OFF: False}[choice]


class Replayable(Protocol):
    def replay(self) -> None: ...


Capturer = Callable[[Callable[[], Any], torch.device, Any], Replayable]  # (run, device, pool) -> graph


def cuda_graph(run: Callable[[], Any], device: torch.device, memory_pool: Any) -> torch.cuda.CUDAGraph:
    """`run` captured in a CUDA graph in `memory_pool` (warmed up twice on a side stream first)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # lazy initialisations happen off the capture
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory_pool):
        run()
    return graph


@dataclass
class EagerGraph:
    """A stand-in for a captured graph: replaying runs the callable again (a CPU's capture path)."""

    run: Callable[[], Any]  # what a replay runs

    def replay(self) -> None:
        self.run()


def eager_graph(run: Callable[[], Any], device: torch.device, memory_pool: Any) -> EagerGraph:
    run()  # as a capture runs it once
    return EagerGraph(run)


def memory_pool_for(device: torch.device) -> Any:
    """One memory pool for every graph of an engine (None off CUDA)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


@contextlib.contextmanager
def capturing(device: torch.device) -> Iterator[None]:
    """The model's device current and the garbage collector frozen and off while capturing."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()  # every object alive now is left out of later collections
    gc.disable()
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            yield
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


@dataclass
class CaptureReport:
    """What one capture pass did (the start-up log line and bench/gpu.py's JSON)."""

    captured: int = 0  # buckets whose graph was captured
    failed: int = 0  # buckets that failed to capture (they run eagerly)
    seconds: float = 0.0  # wall time of the pass


def capture_each(shapes: Iterable[Hashable], capture_one: Callable[[Hashable], Any], what: str,
                 graphs: dict) -> CaptureReport:
    """graphs[shape] = capture_one(shape) for each shape in order; a shape that raises is logged
    at WARNING and left out of graphs (it runs eagerly)."""
    report = CaptureReport()
    started = time.perf_counter()
    for shape in shapes:
        try:
            graphs[shape] = capture_one(shape)
            report.captured += 1
        except Exception as exc:  # noqa: BLE001 - this bucket runs eagerly; the others are kept
            report.failed += 1
            log.warning("%s bucket %s failed to capture a CUDA graph (%s: %s); it runs eagerly",
                        what, shape, type(exc).__name__, str(exc)[:300])
    report.seconds = time.perf_counter() - started
    return report
