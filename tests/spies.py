"""Recording spies for the real in-process servers: a gRPC server interceptor that keeps a
copy of every request message of the methods it watches, then lets the call through;
`DelayedCalls`, an interceptor that holds chosen calls of a method back before letting them
through (a slow service, as its clients see it); `held_worker`, which occupies a service's
model worker so that calls queue behind it; and `slowed_model`, which makes a service's model
slower (every forward sleeps per token, as a slower machine's would take longer)."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from typing import Any

import grpc


class RequestRecorder(grpc.aio.ServerInterceptor):
    """Records (method name, request) of unary calls whose method ends in one of `methods`, and
    of the calls on their call streams (ProposeStream carries Propose calls: recorded as
    ("Propose", the ProposeRequest))."""

    def __init__(self, *methods: str):
        self.methods = tuple(f"/{m}" if not m.startswith("/") else m for m in methods)
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    def _record(self, name: str, request: Any) -> None:
        copy = type(request)()
        copy.CopyFrom(request)
        with self._lock:
            self.calls.append((name, copy))

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # e.g. /specdec.v1.DraftService/Propose
        if handler is not None and handler.stream_stream is not None and method.endswith("Stream") \
                and method[:-len("Stream")].endswith(self.methods):
            return self._stream_recording(method.rsplit("/", 1)[-1][:-len("Stream")], handler)
        if handler is None or handler.unary_unary is None or not method.endswith(self.methods):
            return handler
        inner = handler.unary_unary

        async def recording(request, context):
            self._record(method.rsplit("/", 1)[-1], request)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            recording, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _stream_recording(self, name: str, handler):
        inner = handler.stream_stream

        async def recording(requests, context):
            async def recorded():
                async for item in requests:
                    self._record(name, item.request)
                    yield item

            async for response in inner(recorded(), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(
            recording, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def take(self) -> list[tuple[str, Any]]:
        """The calls recorded so far, and forget them."""
        with self._lock:
            calls, self.calls = self.calls, []
        return calls


class DelayedCalls(grpc.aio.ServerInterceptor):
    """Holds the n-th call of `method` (counted from 1, over its unary calls and the calls on its
    call stream) back for delays[n] seconds, then lets it through unchanged."""

    def __init__(self, method: str, delays: dict[int, float]):
        self.method = f"/{method}" if not method.startswith("/") else method
        self.delays = dict(delays)
        self.count = 0

    async def _wait(self) -> None:
        self.count += 1  # one event loop: no lock needed
        delay = self.delays.get(self.count, 0.0)
        if delay:
            await asyncio.sleep(delay)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is not None and handler.stream_stream is not None and method.endswith(self.method + "Stream"):
            inner_stream = handler.stream_stream

            async def delayed_stream(requests, context):
                async def delayed():
                    async for item in requests:
                        await self._wait()
                        yield item

                async for response in inner_stream(delayed(), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                delayed_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler is None or handler.unary_unary is None or not method.endswith(self.method):
            return handler
        inner = handler.unary_unary

        async def delayed_call(request, context):
            await self._wait()
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            delayed_call, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


@contextmanager
def held_worker(servicer, queued: int | None = None):
    """Occupy the model worker; on exit, wait until `queued` calls wait for it, then free it."""
    started, free = threading.Event(), threading.Event()

    def hold():
        started.set()
        free.wait(60)

    servicer.worker.submit(hold)
    assert started.wait(10)
    try:
        yield
        deadline = time.monotonic() + 30
        while queued is not None and servicer.worker.queue_depth < queued:
            assert time.monotonic() < deadline, "the calls never queued"
            time.sleep(0.01)
    finally:
        free.set()


@contextmanager
def slowed_model(servicer, seconds_per_token: float):
    """Every forward of the service's engine takes `seconds_per_token` longer per input token
    (on the model worker, as a slower model would), until the context exits. The engine itself
    is unchanged: its forwards are wrapped, and the wrapper is removed on exit."""
    engine = servicer.engine
    forward = engine.forward_batch

    def slow_forward_batch(rows):
        time.sleep(seconds_per_token * sum(len(row.tokens) for row in rows))
        return forward(rows)

    engine.forward_batch = slow_forward_batch
    try:
        yield
    finally:
        del engine.forward_batch
