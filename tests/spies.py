"""Recording spies for the real in-process servers: a gRPC server interceptor that keeps a
copy of every request message of the methods it watches, then lets the call through; and
`held_worker`, which occupies a service's model worker so that calls queue behind it."""

from __future__ import annotations

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
