"""What logs and messages may show of secrets. Session ids are bearer secrets: whoever holds
one can continue and read the session, so logs name a session by a short tag that cannot be
turned back into its id. Store URLs may carry a password: messages show them redacted."""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl, urlencode


def session_tag(session_id: str) -> str:
    """The first 8 hex digits of sha256(session_id): enough to match log lines, not to reuse."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:8]


def redacted_url(url: str) -> str:
    """`url` without its credentials (user info, a `password=` query value), for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if "@" in url else url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        pairs = [(k, "***" if k.lower() == "password" else v)
                 for k, v in parse_qsl(query, keep_blank_values=True)]
        tail = path + "?" + urlencode(pairs, safe="*") + hash_ + fragment
    return f"{scheme}://{netloc}{tail}"
