"""How bench/overhead.py times a round: spans on the monotonic clock recorded in every process
(Intervals), when each streamed chunk of a request arrived and the CPU each process spent
meanwhile (chunk_times), two bare unary calls as the floor, and a round's wall time split into
the model work and the parts of orchestration (rounds: `service`, `grpc`, `store`, `rest`)."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left

from bench.processes import cpu_of, cpu_spent
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2


class Intervals:
    """(start, end) intervals on the monotonic clock (time.perf_counter is CLOCK_MONOTONIC on
    Linux, the same in every process) recorded by wrapped functions (any thread)."""

    def __init__(self, spans: list[tuple[float, float]] | None = None) -> None:
        self.spans: list[tuple[float, float]] = [tuple(s) for s in spans or []]
        self.lock = threading.Lock()

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.spans.append((t0, time.perf_counter()))
        return timed

    def wrap_async(self, fn):
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.spans.append((t0, time.perf_counter()))
        return timed

    def merged(self, *others: "Intervals") -> "Intervals":
        """The union of these spans and others' (overlaps counted once)."""
        spans = sorted([*self.spans, *(s for o in others for s in o.spans)])
        out: list[tuple[float, float]] = []
        for s, e in spans:
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return Intervals(out)

    def within(self, start: float, end: float) -> float:
        """Seconds of recorded spans inside [start, end]."""
        if getattr(self, "_sorted_n", -1) != len(self.spans):
            with self.lock:
                self._sorted, self._sorted_n = sorted(self.spans), len(self.spans)
        spans = self._sorted
        # spans start in order; one that starts before `start` may still reach into it
        total = 0.0
        for s, e in spans[max(0, bisect_left(spans, (start, start)) - 64):]:
            if s > end:
                break
            total += max(0.0, min(e, end) - max(s, start))
        return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def rounds(gamma: int, per_request: list[list[float]], work: Intervals, forwards: Intervals,
           handlers: Intervals, calls: Intervals, saves: Intervals) -> dict:
    """Per round (each chunk after a request's first): wall, model work, orchestration and its
    parts (ms); see bench/overhead.py's docstring."""
    covered = calls.merged(saves)
    parts: dict[str, list[float]] = {k: [] for k in ("wall", "work", "orchestration", "beyond_forward",
                                                     "service", "grpc", "store", "rest")}
    for stamps in per_request:
        for start, end in zip(stamps, stamps[1:]):
            w, m, f = end - start, work.within(start, end), forwards.within(start, end)
            h, c = handlers.within(start, end), calls.within(start, end)
            for key, value in (("wall", w), ("work", m), ("orchestration", w - m), ("beyond_forward", w - f),
                               ("service", h - m), ("grpc", c - h), ("store", saves.within(start, end)),
                               ("rest", w - covered.within(start, end))):
                parts[key].append(1000 * value)
    out = {"gamma": gamma, "rounds": len(parts["wall"]), "samples": parts["orchestration"],
           "orchestration_p99": percentile(parts["orchestration"], 0.99)}
    out.update({f"{key}_p50": percentile(values, 0.5) for key, values in parts.items()})
    return out


def bare_calls(draft, target, n: int = 300) -> dict:
    times = bare_times(draft, target, n)
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99)}


def bare_times(draft, target, n: int) -> list[float]:
    """ms of each of n pairs of bare unary calls (GetModelInfo on the draft, then the target)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        draft.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
        target.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        times.append(1000 * (time.perf_counter() - t0))
    return times


STAT_FIELDS = ("rounds", "generated_tokens", "draft_rounds", "draft_tokens", "accepted_tokens",
               "draft_ahead_calls", "draft_ahead_rounds")


def chunk_times(stub, gamma: int, requests: int, max_new: int, pids: dict[str, int],
                proposer: int = coordinator_pb2.PROPOSER_UNSPECIFIED, tally: dict | None = None,
                ) -> tuple[list[list[float]], dict[str, float | None]]:
    """Per request, when each streamed chunk (one round) arrived; and the CPU seconds each
    process in `pids` spent from each request's first chunk to the end of its stream, summed
    (None where /proc cannot tell). A `tally` given gets the tokens of the timed rounds (every
    chunk after a request's first), their seconds, and the sums of the requests' STAT_FIELDS."""
    out, spent = [], {name: 0.0 for name in pids}
    if tally is not None:
        for key in ("tokens", "seconds", *STAT_FIELDS):
            tally.setdefault(key, 0)
    for i in range(requests):
        request = coordinator_pb2.GenerateRequest(
            prompt=f"def f{i}(x):", max_new_tokens=max_new, num_speculative_tokens=gamma, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0), proposer=proposer)
        stamps, first, tokens, stats = [], None, 0, None
        for chunk in stub.Generate(request, timeout=600):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                tokens += len(chunk.token_ids) if len(stamps) > 1 else 0
                first = first or cpu_of(pids)  # from the first round's end: the rounds timed below
            if chunk.HasField("stats"):
                stats = chunk.stats
        out.append(stamps)
        if first is not None:
            for name, seconds in cpu_spent(first, cpu_of(pids)).items():
                spent[name] = None if seconds is None or spent[name] is None else spent[name] + seconds
        if tally is not None and len(stamps) > 1:
            tally["tokens"] += tokens
            tally["seconds"] += stamps[-1] - stamps[0]
            for key in STAT_FIELDS:
                tally[key] += getattr(stats, key) if stats is not None else 0
    return out, spent
