"""Batching: the final steps of concurrent calls run as ONE task on the model worker.

A call's final step (a Verify's forward + acceptance, a Propose's drafting) waits here until a
batch is ready — `max_batch_size` calls, `max_batch_tokens` padded tokens, every session of the
last two batches already waiting (nobody else is expected), or the oldest has waited
`batch_wait_s` — and a drain task on the worker then takes what is waiting (at most one call
per session, in arrival order) and runs it through `run_batch`, which answers each call on its
own: one row's failure is that call's error only.

Calls that arrive while a batch runs wait for the next one (continuous batching). Waiting calls
hold their place in the worker's bounded queue, so the queue bound still answers
RESOURCE_EXHAUSTED; a call whose caller went away is dropped, and one whose deadline passed
while it waited fails without running.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

from specdec.runtime.serving.worker import DeadlinePassed, ModelWorker

C = TypeVar("C")
R = TypeVar("R")

RECENT_BATCHES = 2  # a session in one of the last this many batches is expected back: worth waiting for


@dataclass
class _Waiting:
    call: Any
    session_id: str
    tokens: int
    deadline: float | None
    arrived: float
    future: Future = field(default_factory=Future)


class BatchScheduler(Generic[C, R]):
    """Collects calls (of type C, with a session_id) on the event loop; runs them in batches on
    the model worker; hands each caller its own result R or error."""

    def __init__(self, worker: ModelWorker, run_batch: Callable[[list[C]], Sequence[R | BaseException]],
                 tokens_of: Callable[[C], int], max_batch_size: int = 32, max_batch_tokens: int = 4096,
                 batch_wait_s: float = 0.002):
        self.worker = worker
        self.run_batch = run_batch
        self.tokens_of = tokens_of
        self.max_batch_size = max(1, max_batch_size)
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.batch_wait_s = max(0.0, batch_wait_s)
        self.batch_sizes: Counter[int] = Counter()  # batches run, by number of calls
        self.on_batch: Callable[[int], None] | None = None  # told each batch's size (metrics)
        self._waiting: deque[_Waiting] = deque()
        self._recent: dict[str, int] = {}  # session -> number of the last batch it ran in
        self._batches = 0
        self._lock = threading.Lock()
        self._drain_queued = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # touched on the event loop only

    async def run(self, call: C, deadline: float | None) -> R:
        """Run call's final step in the next batch; its result (or its own error)."""
        self._loop = asyncio.get_running_loop()
        self.worker.reserve()  # RESOURCE_EXHAUSTED when the queue is full
        item = _Waiting(call, call.session_id, self.tokens_of(call), deadline, time.monotonic())
        item.future.add_done_callback(self._forget)
        with self._lock:
            self._waiting.append(item)
            delay = self._delay_locked(item.arrived)
        if delay <= 0:
            self._request_drain()
        else:
            self._arm_timer(delay)
        return await asyncio.wrap_future(item.future)

    def forget(self, session_id: str) -> None:
        """The session is gone (released): do not wait for it."""
        with self._lock:
            self._recent.pop(session_id, None)

    # ---- readiness ----------------------------------------------------------------------------

    def _delay_locked(self, now: float) -> float:
        """Seconds to wait before the waiting calls should run (<= 0: now)."""
        waiting = self._waiting
        if not waiting:
            return float("inf")
        if self.batch_wait_s == 0 or len(waiting) >= self.max_batch_size:
            return 0.0
        longest = max(w.tokens for w in waiting)
        if len(waiting) * longest >= self.max_batch_tokens:
            return 0.0
        sessions = {w.session_id for w in waiting}
        if all(sid in sessions for sid in self._recent):
            return 0.0  # nobody else is expected
        return waiting[0].arrived + self.batch_wait_s - now

    def _arm_timer(self, delay: float) -> None:
        """(event loop) Run a drain after `delay` unless a timer is already set."""
        if self._timer is None:
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        with self._lock:
            delay = self._delay_locked(time.monotonic())
        if delay <= 0:
            self._request_drain()
        elif delay != float("inf"):
            self._arm_timer(delay)

    def _request_drain(self) -> None:
        """Queue a drain on the worker unless one is queued and not yet started (it will take
        whatever is waiting when it starts)."""
        with self._lock:
            if self._drain_queued:
                return
            self._drain_queued = True
        self.worker.submit(self._drain, counted=False)

    def _forget(self, future: Future) -> None:
        if future.cancelled():  # the caller went away before its batch took it
            self.worker.unreserve()

    # ---- the drain (model worker thread) ------------------------------------------------------

    def _take_locked(self) -> list[_Waiting]:
        """Up to the limits, in arrival order, one call per session (a later call of a session
        already in the batch waits for the next)."""
        batch: list[_Waiting] = []
        later: deque[_Waiting] = deque()
        sessions: set[str] = set()
        longest = 0
        while self._waiting:
            item = self._waiting.popleft()
            if item.future.cancelled():
                continue
            if item.session_id in sessions:
                later.append(item)
                continue
            longest_with = max(longest, item.tokens)
            if batch and (len(batch) >= self.max_batch_size
                          or (len(batch) + 1) * longest_with > self.max_batch_tokens):
                self._waiting.appendleft(item)
                break
            batch.append(item)
            sessions.add(item.session_id)
            longest = longest_with
        later.extend(self._waiting)
        self._waiting = later
        return batch

    def _drain(self) -> None:
        with self._lock:
            self._drain_queued = False
            taken = self._take_locked()
        try:
            self._start(taken)
        finally:
            for item in taken:  # a bug above must not leave a caller waiting forever
                if item.future.running():
                    item.future.set_exception(RuntimeError("the batch scheduler failed"))
        with self._lock:
            delay = self._delay_locked(time.monotonic())
        if delay <= 0:
            self._request_drain()
        elif delay != float("inf") and self._loop is not None:
            self._loop.call_soon_threadsafe(self._arm_timer, delay)

    def _start(self, taken: list[_Waiting]) -> None:
        """Drop the calls whose caller went away or whose deadline passed; run the rest."""
        now = time.monotonic()
        batch = []
        for item in taken:
            if not item.future.set_running_or_notify_cancel():
                continue  # cancelled: its place was given back by _forget
            self.worker.unreserve()
            if item.deadline is not None and now > item.deadline:
                item.future.set_exception(DeadlinePassed("the call's deadline passed while it was queued"))
                continue
            batch.append(item)
        if batch:
            self._run(batch)

    def _run(self, batch: list[_Waiting]) -> None:
        self.batch_sizes[len(batch)] += 1
        if self.on_batch is not None:
            self.on_batch(len(batch))
        with self._lock:
            self._batches += 1
            for item in batch:
                self._recent[item.session_id] = self._batches
            oldest = self._batches - RECENT_BATCHES
            for sid in [s for s, n in self._recent.items() if n <= oldest]:
                del self._recent[sid]
        try:
            results = self.run_batch([item.call for item in batch])
        except BaseException as exc:  # the whole batch failed (e.g. out of memory in its forward)
            results = [exc] * len(batch)
        for item, result in zip(batch, results):
            if isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)


def batch_scheduler(config: Any, worker: ModelWorker, run_batch: Callable[[list[C]], Sequence[R | BaseException]],
                    tokens_of: Callable[[C], int]) -> BatchScheduler[C, R]:
    """A scheduler with a ModelServiceConfig's batch limits."""
    return BatchScheduler(worker, run_batch, tokens_of, max_batch_size=config.max_batch_size,
                          max_batch_tokens=config.max_batch_tokens, batch_wait_s=config.batch_wait_ms / 1000)
