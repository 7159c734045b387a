"""Session ids are bearer secrets: logs at INFO and above never contain them, only a tag.

Here the unit tests; the other tiers' are in tests/e2e/test_log_secrets.py.
"""

from __future__ import annotations

from specdec.logtag import session_tag


def test_session_tag_is_short_and_stable():
    assert session_tag("abc") == session_tag("abc") != session_tag("abd")
    assert len(session_tag("abc")) == 8 and "abc" not in session_tag("abc")
