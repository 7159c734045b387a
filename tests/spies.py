"""Recording spies for the real in-process servers: a gRPC server interceptor that keeps a
copy of every request message of the methods it watches, then lets the call through."""

from __future__ import annotations

import threading
from typing import Any

import grpc


class RequestRecorder(grpc.aio.ServerInterceptor):
    """Records (method name, request) of unary calls whose method ends in one of `methods`."""

    def __init__(self, *methods: str):
        self.methods = tuple(f"/{m}" if not m.startswith("/") else m for m in methods)
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # e.g. /specdec.v1.DraftService/Propose
        if handler is None or handler.unary_unary is None or not method.endswith(self.methods):
            return handler
        inner = handler.unary_unary

        async def recording(request, context):
            copy = type(request)()
            copy.CopyFrom(request)
            with self._lock:
                self.calls.append((method.rsplit("/", 1)[-1], copy))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            recording, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def take(self) -> list[tuple[str, Any]]:
        """The calls recorded so far, and forget them."""
        with self._lock:
            calls, self.calls = self.calls, []
        return calls
