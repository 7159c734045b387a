"""A server interceptor that counts finished calls by method and status code (and times them).

Every specdec.v1 method of a server goes through it (health checks and reflection do not):
`specdec_requests_total{method, code}` moves once per call, with the code the client saw —
OK, the status a domain error was mapped to, CANCELLED when the client went away, INTERNAL
for anything unexpected. Methods named in `stages` also observe their duration as that
stage of `specdec_round_latency_seconds` (the draft times Propose, the target Verify).

A call stream (ProposeStream, VerifyStream: see specdec/rpc/streaming.py) is not counted
itself: each call on it counts as the unary call it stands for (method Propose or Verify, the
code its answer carries, timed from its request's arrival to its answer), and a call still
running when the stream ends counts as CANCELLED, as a cancelled unary call does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Mapping

import grpc

from specdec.metrics import Metrics
from specdec.rpc.streaming import STREAM_SUFFIX, code_of

COUNTED_PREFIX = "/specdec.v1."


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics, stages: Mapping[str, str] | None = None):
        self.metrics = metrics
        self.stages = dict(stages or {})  # method name -> stage
        # full method name -> (the handler, its counting wrapper): wrapped once, not per call
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method or ""
        if handler is None or not full.startswith(COUNTED_PREFIX):
            return handler
        cached = self._wrapped.get(full)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(full.rsplit("/", 1)[-1], handler)
        self._wrapped[full] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: Any) -> Any:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(method, handler.unary_stream), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_stream is not None and method.endswith(STREAM_SUFFIX):
            return grpc.stream_stream_rpc_method_handler(
                self._call_stream(method[:-len(STREAM_SUFFIX)], handler.stream_stream),
                handler.request_deserializer, handler.response_serializer)
        return handler  # no other client-streaming methods in the API

    def _unary(self, method: str, behavior: Callable) -> Callable:
        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                self._finish(method, _code_of(exc, context), started)
                raise
            self._finish(method, _code(context) or grpc.StatusCode.OK, started)
            return response
        return counted

    def _streaming(self, method: str, behavior: Callable) -> Callable:
        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            try:
                call = behavior(request, context)
                if hasattr(call, "__aiter__"):
                    async for response in call:
                        yield response
                else:  # a coroutine handler (writes with context.write, or aborts)
                    await call
            except BaseException as exc:
                self._finish(method, _code_of(exc, context), started)
                raise
            self._finish(method, _code(context) or grpc.StatusCode.OK, started)
        return counted

    def _call_stream(self, method: str, behavior: Callable) -> Callable:
        """Count each call of a call stream as a unary `method` call."""
        async def counted(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            started: dict[int, float] = {}  # call_id -> when its request arrived

            async def arrivals() -> Any:
                async for request in requests:
                    started[request.call_id] = time.perf_counter()
                    yield request

            try:
                async for response in behavior(arrivals(), context):
                    began = started.pop(response.call_id, None)
                    if began is not None:
                        self._finish(method, code_of(response), began)
                    yield response
            finally:
                for began in started.values():  # cancelled with the stream
                    self._finish(method, grpc.StatusCode.CANCELLED, began)
                started.clear()
        return counted

    def _finish(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.metrics.record_request(method, code)
        stage = self.stages.get(method)
        if stage is not None and code == grpc.StatusCode.OK:
            self.metrics.observe_stage(stage, time.perf_counter() - started)


def _code(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    try:
        return context.code()
    except (AttributeError, NotImplementedError):
        return None


def _code_of(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call that raised ends with."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    code = _code(context)
    if isinstance(exc, grpc.aio.AbortError) and code is not None:
        return code
    return code if code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.INTERNAL
