"""Work started ahead and no longer wanted."""

from __future__ import annotations

import asyncio


async def discard(task: asyncio.Future) -> None:
    """Cancel work whose result is no longer wanted and wait until it has ended (its error, if
    any, is dropped: the request already ends for its own reason)."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: not logged as never retrieved
