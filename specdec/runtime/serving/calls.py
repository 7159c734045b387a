"""Running one Propose / Verify call on the model worker, long inputs in chunks.

The call's final step goes through the batch scheduler, which runs it together with other
sessions' final steps in one forward. A call whose new tokens exceed the engine's prefill chunk
is split into prefill steps, each a separate task on the worker, so other sessions' rounds run
in between. A step whose caller's deadline has passed is never started; the steps already done
stay in the cache, and a resend (prefix_len 0 with the full history) picks up where they ended
instead of starting again. After each step the call reports its progress (specdec/progress.py),
and its deadline moves on: a call that is working gets its whole timeout again from each
finished step (the client of a call stream counts its deadline the same way), so a long input
is never dropped for being long.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from typing import Any, Protocol, Sequence, TypeVar

from specdec import progress
from specdec.errors import CacheMiss
from specdec.runtime.engine import ModelEngine
from specdec.runtime.serving.scheduler import BatchScheduler

R = TypeVar("R")
PREFILL_ATTEMPTS = 3  # prefills of one call whose session was evicted before its final step


class SessionCall(Protocol):
    session_id: str
    prefix_len: int
    prefix_hash: int
    new_tokens: Sequence[int]
    cache_salt: str


C = TypeVar("C", bound=SessionCall)


def deadline_of(context: Any) -> float | None:
    """The gRPC call's deadline as a time.monotonic() value (None: no deadline)."""
    remaining = context.time_remaining() if context is not None else None
    return None if remaining is None else time.monotonic() + remaining


def moved_on(deadline: float | None, window: float | None) -> float | None:
    """A working call's deadline after one of its steps finished: its window again from now."""
    return None if deadline is None or window is None else max(deadline, time.monotonic() + window)


async def run_call(scheduler: BatchScheduler, engine: ModelEngine, call: C, deadline: float | None) -> R:
    """Prefill the call's input in chunks when it is long, then run its final step in a batch.

    The session can be evicted between the last chunk and the final step (other sessions' calls
    run in between and the cache budget holds): the prefill then runs again, a bounded number of
    times, rather than answering the caller's complete history with a cache miss."""
    worker = scheduler.worker
    if not engine.needs_prefill_steps(call.new_tokens):
        return await scheduler.run(call, deadline)
    window = None if deadline is None else deadline - time.monotonic()
    held = await worker.run(engine.held_prefix, call.session_id, call.prefix_len, call.prefix_hash,
                            deadline=deadline)
    sequence = held + array("i", call.new_tokens)
    upto = len(sequence) - 1  # the last token runs with the final step, for its logits
    progress.report(len(held), upto)
    for attempt in range(PREFILL_ATTEMPTS):
        while True:
            length, prefix_hash = await worker.run(engine.prefill_step, call.session_id, sequence, upto,
                                                   call.cache_salt, deadline=deadline)
            progress.report(length, upto)
            deadline = moved_on(deadline, window)
            if length >= upto:
                break
        final = dataclasses.replace(call, prefix_len=upto, prefix_hash=prefix_hash,
                                    new_tokens=sequence[upto:].tolist())
        try:
            return await scheduler.run(final, deadline)
        except CacheMiss:
            if attempt == PREFILL_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
