"""Domain errors. Each maps to one gRPC status code in specdec.rpc.status (one place)."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class; the message is what the user sees."""


class InvalidArgument(SpecdecError):
    """The request is malformed or out of range. field: the request field at fault, as the domain
    names it (specdec.fields.Field), when it is one; the message names it the same way."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class NotFound(SpecdecError):
    """A named entity (session) does not exist."""


class FailedPrecondition(SpecdecError):
    """The request is valid but the system is not in a state to serve it."""


class CacheMiss(FailedPrecondition):
    """A service does not hold the prefix the request assumes; resend from prefix_len 0."""

    def __init__(self, session_id: str, held: int, assumed: int):
        self.session_id = session_id
        self.held = held
        self.assumed = assumed
        super().__init__(
            f"cache miss for session {session_id!r}: this service holds {held} tokens but the "
            f"request assumes prefix_len={assumed}; resend with prefix_len=0 and the full history"
        )


class SessionBusy(FailedPrecondition):
    """Another request holds the session's lease. retry_after_s, when given, is how long until
    the lease can change hands even if its holder is gone (a client may retry sooner)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class ResourceExhausted(SpecdecError):
    """A limit was reached; retry later (after retry_after_s, when given) or with a smaller request."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        self.retry_after_s = retry_after_s
        super().__init__(message)


def retry_after_s(error: SpecdecError) -> float | None:
    """When a client may usefully retry after `error` (seconds), where the error says so."""
    if isinstance(error, (ResourceExhausted, SessionBusy)):
        return error.retry_after_s
    return None


class Unavailable(SpecdecError):
    """A dependency (service, store) cannot be reached."""


class DeadlineExceeded(Unavailable):
    """A call to a service outlasted its deadline: the service may be down, or only slow."""


class ServiceFault(SpecdecError):
    """A downstream service failed unexpectedly (a bug, not bad input): reported as INTERNAL."""
