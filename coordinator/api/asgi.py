"""The ASGI plumbing of the OpenAI-compatible HTTP API (openai_api.py), which knows nothing of
OpenAI's shapes: `EventStream` (server-sent events, cancelled once when the client goes away),
`sse` (one event), `until_disconnected` (work cancelled when the client goes away before its
response begins, answered `CLIENT_CLOSED`) and `CountedRequests` (the middleware that counts
every HTTP call by route and status).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

log = logging.getLogger(__name__)

T = TypeVar("T")


class EventStream(StreamingResponse):
    """A text/event-stream response driven by plain asyncio tasks. A client that goes away
    cancels the events' generator once, as gRPC cancels a call, so the round loop's cleanup (the
    session's lease and caches released) runs to its end; StreamingResponse on an ASGI 2.3
    server (uvicorn) cancels through an anyio cancel scope, which cancels every await of that
    cleanup again and leaves the session busy."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            for outcome in await asyncio.gather(streaming, watching, return_exceptions=True):
                if isinstance(outcome, Exception):  # the client went away while a chunk was sent
                    log.debug("OpenAI API: stream ended: %r", outcome)


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


CLIENT_CLOSED = 499  # the client went away before its response began (nginx's name for it)


async def until_disconnected(http: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first: then `work` is cancelled and
    awaited, so what it was running is cleaned up before this returns. The request's body must
    have been read (the next ASGI message is then the disconnect)."""
    doing = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait((doing, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not doing.done():
            doing.cancel()
        await asyncio.gather(doing, watching, return_exceptions=True)
    if doing.cancelled():
        log.info("OpenAI API: the client went away before its response began; generation cancelled")
        return None
    return doing.result()


async def _disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


class CountedRequests:
    """ASGI middleware: every finished HTTP call counted by its route and status (an unknown
    path as "unmatched", so the label's values stay few; an exception that escapes as 500)."""

    def __init__(self, app: Any, record: Callable[[str, int], None]):
        self.app, self.record = app, record

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def sending(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.record(getattr(scope.get("route"), "path", "unmatched"), status)
