"""Unary calls multiplexed on one long-lived bidirectional stream (ProposeStream, VerifyStream).

A unary call pays for a new HTTP/2 stream (headers both ways, trailers) every time; a message on
a stream that is already open costs less (docs/benchmarks.md has the measured round trips), and
the coordinator makes two such calls per round. So each stream request carries
one call (a `call_id` the client picks, the unary request, the call's own timeout) and each
response answers one call: the unary response, or the status the unary call would have ended
with (code, message, trailing metadata), so the client raises the very same domain error.

Server side, `serve_calls` runs every request as its own task through the unary handler's path
(the same batch scheduler: calls of many sessions on one stream still share forwards) and
yields each answer as it completes, in whatever order that is. Client side, `CallStream` keeps
one stream per client, a writer task and a reader task resolving each call's future; a broken
stream fails its calls in flight with the stream's status (UNAVAILABLE when the server went
away) and the next call opens a new one.

A call may have an idle limit: the longest it may go without its answer or a progress message.
The server sends one after each chunk of a long input (specdec/progress.py) and, as a
heartbeat, every `heartbeat_ms` the call asks for while it runs (from its event loop, which
answers while the model works): a call that is working, however slowly, keeps hearing from it,
while a service that stopped answering (a stopped process, a forward that holds the
interpreter) goes silent and is given up within the idle limit. The deadline of a call with an
idle limit counts from its start and again from each chunk it finished (without one, the
deadline is a fixed budget: a Propose's). A server that does not announce progress (an older
one) is held to the deadline only. Both fail the call with DEADLINE_EXCEEDED, saying which
limit it hit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from specdec import errors, progress
from specdec.rpc.status import code_for, trailers_for
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

STREAM_SUFFIX = "Stream"  # ProposeStream carries Propose calls, VerifyStream Verify calls
# Initial metadata a call stream's server sends at once: the client writes only after it, so
# a server that refuses the stream (an older one: UNIMPLEMENTED) is told apart for certain (a
# write racing the refusal would fail locally and hide the server's status).
READY_METADATA = (("specdec-call-stream", "1"),)
# ... and this one too when it sends progress messages for long calls (older servers do not)
PROGRESS_METADATA = ("specdec-call-progress", "1")
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_READ_DONE = object()


# ---- errors as messages -----------------------------------------------------------------------

def error_to_pb(exc: BaseException) -> common_pb2.StreamCallError:
    """The status a unary handler failing with `exc` ends with: a domain error's code, message and
    trailers (as map_errors sets them), INTERNAL for anything else (as grpc answers it)."""
    if isinstance(exc, errors.SpecdecError):
        return common_pb2.StreamCallError(code=code_for(exc).value[0], message=str(exc),
                                          trailing_metadata=dict(trailers_for(exc)))
    return common_pb2.StreamCallError(code=grpc.StatusCode.INTERNAL.value[0],
                                      message=f"Unexpected {type(exc)}: {exc}")


def code_of(response: Any) -> grpc.StatusCode:
    """The status code of one stream response (OK when it carries the unary response)."""
    if response.WhichOneof("outcome") != "error":
        return grpc.StatusCode.OK
    return _CODES.get(response.error.code, grpc.StatusCode.UNKNOWN)


class CallStatus(grpc.RpcError):
    """A streamed call's failure, shaped like a failed unary call (code, details, trailing
    metadata) so from_rpc_error maps both transports alike."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailing = code, details, trailing

    @classmethod
    def from_pb(cls, error: common_pb2.StreamCallError) -> "CallStatus":
        return cls(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message,
                   tuple(error.trailing_metadata.items()))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


# ---- server side ------------------------------------------------------------------------------

def deadline_of(request: Any) -> float | None:
    """A stream request's deadline as a time.monotonic() value, counted from now (its arrival),
    as gRPC counts a unary call's (None: no deadline)."""
    return time.monotonic() + request.timeout_ms / 1000 if request.timeout_ms else None


async def serve_calls(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      run: Callable[[Any, float | None], Awaitable[Any]], response_type: type
                      ) -> AsyncIterator[Any]:
    """Answer every call read from `requests` with run(request.request, deadline), each call
    its own task; yield the answers as they complete. A call's error is its answer only. When
    the client stops sending, the stream ends once the calls in flight are answered; when it
    goes away (this generator is cancelled or closed), the calls in flight are cancelled."""
    await context.send_initial_metadata(READY_METADATA + (PROGRESS_METADATA,))
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue = asyncio.Queue()
    tasks: set[asyncio.Task] = set()

    async def one(call_id: int, request: Any, deadline: float | None, heartbeat_s: float) -> None:
        report = common_pb2.StreamCallProgress()

        def send(done: int, total: int) -> None:
            report.tokens_done, report.tokens_total = done, total
            answers.put_nowait(response_type(call_id=call_id, progress=report))

        progress.reporting_to(send)
        beating = _Heartbeat(loop, heartbeat_s, lambda: send(report.tokens_done, report.tokens_total))
        try:
            answer = response_type(call_id=call_id, response=await run(request, deadline))
        except errors.SpecdecError as exc:
            answer = response_type(call_id=call_id, error=error_to_pb(exc))
        except Exception as exc:  # a bug: INTERNAL for this call, as a unary handler's would be
            log.exception("streamed call %d failed", call_id)
            answer = response_type(call_id=call_id, error=error_to_pb(exc))
        finally:
            beating.cancel()
        answers.put_nowait(answer)  # exactly one answer per call (unless cancelled)

    reading, outstanding, failure = True, 0, None

    async def read() -> None:
        nonlocal outstanding, failure
        try:
            async for item in requests:
                task = loop.create_task(one(item.call_id, item.request, deadline_of(item), item.heartbeat_ms / 1000))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                outstanding += 1
        except Exception as exc:  # the stream broke: end this side too
            failure = exc
        finally:
            answers.put_nowait(_READ_DONE)

    reader = loop.create_task(read())
    try:
        while reading or outstanding:
            item = await answers.get()
            if item is _READ_DONE:
                reading = False
                if failure is not None:
                    raise failure
                continue
            if item.WhichOneof("outcome") != "progress":
                outstanding -= 1
            yield item
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()


class _Heartbeat:
    """Calls beat() every every_s seconds until cancelled (never when every_s is 0); a timer,
    not a task: it costs a call that ends before its first beat next to nothing."""

    def __init__(self, loop: asyncio.AbstractEventLoop, every_s: float, beat: Callable[[], None]):
        self._loop, self._every_s, self._beat = loop, every_s, beat
        self._timer = loop.call_later(every_s, self._fire) if every_s > 0 else None

    def _fire(self) -> None:
        self._beat()
        self._timer = self._loop.call_later(self._every_s, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


# ---- client side ------------------------------------------------------------------------------

def _millis(timeout_s: float) -> int:
    """A timeout as a stream request's timeout_ms (uint32: at least 1, at most ~49 days)."""
    return min(max(1, math.ceil(timeout_s * 1000)), 2**32 - 1)


def _details(exc: BaseException) -> str:
    return exc.details() if isinstance(exc, grpc.RpcError) else repr(exc)


def _deadline_exceeded() -> "CallStatus":
    return CallStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def overran(ran_s: float, limit_s: float, done: int = 0, total: int = 0) -> str:
    """What a call that hit its deadline says: how long it ran against its limit (and how far
    its input got, when it reported that)."""
    return f"ran {ran_s:.1f} s, limit {limit_s:.1f} s" + _how_far(done, total)


def went_silent(silent_s: float, ran_s: float, done: int, total: int) -> str:
    """What a call that got neither its answer nor a progress message within its idle limit says."""
    return (f"no answer and no progress message for {silent_s:.1f} s (the service stopped "
            f"answering) after {ran_s:.1f} s" + _how_far(done, total))


def _how_far(done: int, total: int) -> str:
    return f"; {done:,} of {total:,} tokens done" if total else ""


@dataclass
class _Call:
    """A call in flight on a stream: its future and what its limits are counted from (loop times)."""

    future: asyncio.Future
    started: float
    deadline: float  # the ceiling on its run: its window from its start, or from its last progress
    window: float
    idle_s: float | None  # the longest it may go without an answer or progress (None: no limit)
    heard: float  # when it last heard from the service (its start until it has)
    done: int = 0
    total: int = 0
    timer: asyncio.TimerHandle | None = None


_EARLY_S = 1e-3  # a timer may fire up to the loop's clock resolution early
HEARTBEAT_SHARE = 0.25  # a call with an idle limit asks for a heartbeat 4 times within it


class StreamUnsupported(Exception):
    """The server has no such stream method (an older server): use unary calls."""


class _Stream:
    """One open stream: its call, the calls in flight on it, its writer and reader tasks."""

    def __init__(self, call: Any):
        self.call = call
        self.pending: dict[int, _Call] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.reports_progress: bool | None = None  # None until the server accepted the stream


class CallStream:
    """Calls multiplexed on one long-lived stream of a client, opened on first use (and again
    after it broke). `open` starts the stream RPC; `request_type` wraps one call."""

    def __init__(self, open: Callable[[], Any], request_type: type, channel: grpc.aio.Channel, name: str):
        self._open = open
        self._request_type = request_type
        self._channel = channel
        self.name = name
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self.unsupported = False  # the server answered UNIMPLEMENTED: unary from now on

    async def call(self, request: Any, timeout_s: float, wait_for_ready: bool,
                   idle_s: float | None = None) -> Any:
        """The unary response to `request`; a failure raises what the unary call would
        (a grpc.RpcError: its code, details and trailing metadata), StreamUnsupported when the
        server has no stream method. After timeout_s, or idle_s without an answer or a progress
        message (from a server that reports progress, or has not yet accepted the stream; the
        call asks it for a heartbeat within idle_s): DEADLINE_EXCEEDED, like a unary call, saying
        which. With idle_s, timeout_s counts again from each chunk the call finished (a working
        call is never given up for being long); without, it is a fixed budget."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_s
        call_id = next(self._ids)
        future = loop.create_future()
        stream: _Stream | None = None
        state = None
        try:
            if wait_for_ready and self._stream is None:
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._channel.channel_ready()  # as a unary call with wait_for_ready waits
                except TimeoutError:
                    raise _deadline_exceeded() from None
            stream = self._current()
            state = stream.pending[call_id] = _Call(future, started, deadline, timeout_s, idle_s, loop.time())
            # the limits fail the future themselves: cheaper per call than a timeout scope
            _watch(stream, state)
            stream.outbox.put_nowait(self._request_type(
                call_id=call_id, request=request, timeout_ms=_millis(deadline - loop.time()),
                heartbeat_ms=0 if idle_s is None else _millis(idle_s * HEARTBEAT_SHARE)))
            return await future
        finally:
            if state is not None and state.timer is not None:
                state.timer.cancel()
            if stream is not None:
                stream.pending.pop(call_id, None)  # a late answer is dropped

    def _current(self) -> _Stream:
        if self._stream is None:
            stream = self._stream = _Stream(self._open())
            loop = asyncio.get_running_loop()
            stream.tasks = [loop.create_task(self._write(stream)), loop.create_task(self._read(stream))]
        return self._stream

    async def _write(self, stream: _Stream) -> None:
        """Send the queued calls in order (one write at a time, as gRPC requires; a caller that
        is cancelled never leaves a write half done), once the server has accepted the stream."""
        try:
            metadata = set(await stream.call.initial_metadata() or ())
            if not set(READY_METADATA) <= metadata:
                await stream.call.code()  # refused (UNIMPLEMENTED ...): the reader reports it
                return
            stream.reports_progress = PROGRESS_METADATA in metadata
            while True:
                await stream.call.write(await stream.outbox.get())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke under a write: as if the server went away
            self._break(stream, CallStatus(grpc.StatusCode.UNAVAILABLE,
                                           f"the call stream broke ({_details(exc)})"))

    async def _read(self, stream: _Stream) -> None:
        """Resolve each call's future with its answer; when the stream ends, fail the rest."""
        try:
            while True:
                response = await stream.call.read()
                if response is grpc.aio.EOF:
                    self._break(stream, CallStatus(grpc.StatusCode.UNAVAILABLE, "the call stream ended"))
                    return
                outcome = response.WhichOneof("outcome")
                if outcome == "progress":
                    _heard(stream.pending.get(response.call_id), response.progress)
                    continue
                state = stream.pending.pop(response.call_id, None)
                if state is None or state.future.done():
                    continue  # its caller gave up
                if outcome == "error":
                    state.future.set_exception(CallStatus.from_pb(response.error))
                else:
                    state.future.set_result(response.response)
        except asyncio.CancelledError:
            self._break(stream, CallStatus(grpc.StatusCode.CANCELLED, "the client was closed"))
            raise
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("%s has no call stream (an older server): unary calls from now on", self.name)
                self.unsupported = True
                self._break(stream, StreamUnsupported(exc.details()))
            else:
                self._break(stream, exc)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("%s: call stream reader failed", self.name)
            self._break(stream, CallStatus(grpc.StatusCode.UNAVAILABLE, f"call stream reader: {exc!r}"))

    def _break(self, stream: _Stream, error: BaseException) -> None:
        """The stream is gone: its calls in flight fail with `error`; the next call opens anew."""
        if self._stream is stream:
            self._stream = None
        stream.call.cancel()
        for state in stream.pending.values():
            if not state.future.done():
                state.future.set_exception(error)
        stream.pending.clear()
        for task in stream.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._break(stream, CallStatus(grpc.StatusCode.CANCELLED, "the client was closed"))
            await asyncio.gather(*stream.tasks, return_exceptions=True)


# ---- a call's limits --------------------------------------------------------------------------

def _heard(state: _Call | None, report: common_pb2.StreamCallProgress) -> None:
    """A progress message for a call: its idle limit counts from now; a call with an idle limit
    whose input got further gets its whole window again (as the server counts it:
    specdec/runtime/calls.py)."""
    if state is not None:
        state.heard = asyncio.get_running_loop().time()
        if state.idle_s is not None and report.tokens_done > state.done:
            state.deadline = max(state.deadline, state.heard + state.window)
        state.done, state.total = report.tokens_done, report.tokens_total


def _watch(stream: _Stream, state: _Call) -> None:
    """Fail the call when it passes its ceiling, or its idle limit where that applies; else check
    again when the nearer of the two could pass (progress moves the idle one on)."""
    if state.future.done():
        return
    loop = asyncio.get_running_loop()
    now = loop.time() + _EARLY_S
    idle = state.idle_s is not None and stream.reports_progress is not False
    if idle and now - state.heard >= state.idle_s:
        state.future.set_exception(CallStatus(grpc.StatusCode.DEADLINE_EXCEEDED, went_silent(
            now - state.heard, now - state.started, state.done, state.total)))
        return
    if now >= state.deadline:
        state.future.set_exception(CallStatus(grpc.StatusCode.DEADLINE_EXCEEDED, overran(
            now - state.started, state.window, state.done, state.total)))
        return
    at = min(state.deadline, state.heard + state.idle_s) if idle else state.deadline
    state.timer = loop.call_at(at, _watch, stream, state)
