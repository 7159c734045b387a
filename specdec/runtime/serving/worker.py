"""The model worker: one thread that runs every piece of model work, in arrival order.

gRPC handlers (asyncio) submit work and await it, so the server itself never blocks on the
model: health checks, Release and new calls are answered while a long forward runs. Work
whose caller's deadline passed while it waited is dropped before it starts, and a bounded
queue answers RESOURCE_EXHAUSTED (with a retry-after hint) instead of growing without limit.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from specdec.errors import ResourceExhausted, Unavailable


class DeadlinePassed(Unavailable):
    """The caller's deadline passed before its work could start."""


class ModelWorker:
    def __init__(self, max_queue: int = 256, name: str = "model-worker"):
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._busy_s = 0.05  # moving average of one item's run time, for retry-after hints
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._pending

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, deadline, counted = item
            if not future.set_running_or_notify_cancel():
                continue  # the caller went away while it waited (counted out by _forget)
            if counted:
                self.unreserve()
            if deadline is not None and time.monotonic() > deadline:
                future.set_exception(DeadlinePassed("the call's deadline passed while it was queued"))
                continue
            started = time.monotonic()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the awaiting handler
                future.set_exception(exc)
            self._busy_s = 0.9 * self._busy_s + 0.1 * (time.monotonic() - started)

    def reserve(self) -> None:
        """Take a place in the bounded queue; RESOURCE_EXHAUSTED (with a retry hint) when full.
        Work that waits elsewhere (a batch being collected) holds its place this way."""
        with self._lock:
            if self._pending >= self.max_queue:
                retry = max(0.05, self._pending * self._busy_s)
                raise ResourceExhausted(
                    f"this service has {self._pending} calls queued (the limit, --max-queue); "
                    f"retry in {retry:.2f}s", retry_after_s=retry)
            self._pending += 1

    def unreserve(self) -> None:
        """Give a place back (its work started, or its caller went away)."""
        with self._lock:
            self._pending -= 1

    def submit(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None,
               counted: bool = True) -> Future:
        """Queue fn(*args); deadline is a time.monotonic() value after which it is not started.
        counted=False: internal work that takes no place in the bounded queue."""
        if counted:
            self.reserve()
        future: Future = Future()
        if counted:
            future.add_done_callback(self._forget)
        self._queue.put((future, fn, args, deadline, counted))
        return future

    def _forget(self, future: Future) -> None:
        if future.cancelled():  # never started: it no longer takes a place in the queue
            self.unreserve()

    async def run(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Any:
        return await asyncio.wrap_future(self.submit(fn, *args, deadline=deadline))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
