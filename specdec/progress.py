"""Progress of the call being served, reported to whoever carries the call.

A call whose input is long runs as several pieces of work (prefill chunks, a restore from the
K/V tier). After each, the runtime reports how far it is (`report`); the transport that
carries the call (a call stream: specdec/rpc/streaming.py) installs a reporter for the call's
task (`reporting_to`) and sends each report to the client, which keeps waiting for a call that
is working however long it is, and gives up on one that went silent. Without a reporter (a
unary call, work of the service's own) a report does nothing.
"""

from __future__ import annotations

import contextvars
from typing import Callable

Reporter = Callable[[int, int], None]  # (tokens done, tokens in all)

_REPORTER: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("call_progress", default=None)


def reporting_to(reporter: Reporter) -> None:
    """Send the progress of the call run by the current task (and the tasks it starts) to reporter."""
    _REPORTER.set(reporter)


def report(done: int, total: int) -> None:
    """The current call holds `done` of the `total` tokens its input needs before its final step."""
    reporter = _REPORTER.get()
    if reporter is not None:
        reporter(done, total)
