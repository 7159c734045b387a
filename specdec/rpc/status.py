"""Domain errors -> gRPC status codes, in one place, for servers and clients."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

import grpc

from specdec import errors

log = logging.getLogger(__name__)

CACHE_MISS_KEY = "specdec-cache-miss-held"
RETRY_AFTER_KEY = "retry-after-ms"

_CODES: list[tuple[type[errors.SpecdecError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),  # a subclass of Unavailable: first
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def code_for(error: errors.SpecdecError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def trailers_for(error: errors.SpecdecError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a call failing with `error` carries (what from_rpc_error reads back)."""
    if isinstance(error, errors.CacheMiss):
        return ((CACHE_MISS_KEY, str(error.held)),)
    retry_after_s = errors.retry_after_s(error)
    if retry_after_s is not None:
        return ((RETRY_AFTER_KEY, str(int(retry_after_s * 1000))),)
    return ()


def map_errors(method: Callable) -> Callable:
    """Decorate a servicer method (sync, async or async generator): domain errors abort the
    call with their status code and message."""

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def agen_wrapper(self: Any, request: Any, context: Any):
            try:
                async for item in method(self, request, context):
                    yield item
            except errors.SpecdecError as exc:
                context.set_trailing_metadata(trailers_for(exc))
                await context.abort(code_for(exc), str(exc))
        return agen_wrapper

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def async_wrapper(self: Any, request: Any, context: Any):
            try:
                return await method(self, request, context)
            except errors.SpecdecError as exc:
                context.set_trailing_metadata(trailers_for(exc))
                await context.abort(code_for(exc), str(exc))
        return async_wrapper

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: Any):
        try:
            return method(self, request, context)
        except errors.SpecdecError as exc:
            context.set_trailing_metadata(trailers_for(exc))
            context.abort(code_for(exc), str(exc))
    return wrapper


def from_rpc_error(exc: grpc.RpcError, service: str, work: str = "") -> errors.SpecdecError:
    """A failed call to a downstream service as a domain error the caller can act on; `work`
    (what the call was doing) goes into a timeout's message."""
    code = exc.code()
    detail = exc.details() or ""
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        held = dict(exc.trailing_metadata() or ()).get(CACHE_MISS_KEY)
        if held is not None:
            return errors.CacheMiss("", int(held), -1)
        return errors.FailedPrecondition(f"{service}: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument(f"{service} rejected the request: {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.ResourceExhausted(f"{service}: {detail}")
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFound(f"{service}: {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        doing = f" on {work}" if work else ""
        return errors.DeadlineExceeded(f"{service} ran out of time ({code.name}){doing}: {detail}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED):
        return errors.Unavailable(f"{service} is unavailable ({code.name}): {detail}")
    return errors.ServiceFault(f"{service} failed ({code.name}): {detail}")
