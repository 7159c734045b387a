"""Session ids are bearer secrets: whoever holds one can continue and read the session.
Logs name a session by a short tag that cannot be turned back into its id."""

from __future__ import annotations

import hashlib


def session_tag(session_id: str) -> str:
    """The first 8 hex digits of sha256(session_id): enough to match log lines, not to reuse."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]
