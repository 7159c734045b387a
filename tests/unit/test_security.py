"""Transport security over real servers: TLS on the public port, the API key, mutual TLS
between the coordinator and the tiers, and start-up errors for bad files.

Here the unit tests; the other tiers' are in tests/e2e/test_security.py and
tests/process/test_security.py.
"""

from __future__ import annotations

from specdec.rpc.security import bearer_token


def test_bearer_token_parsing():
    assert bearer_token([("authorization", "Bearer abc ")]) == "abc"
    assert bearer_token([("authorization", "bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) == ""
    assert bearer_token([("x-other", "Bearer abc")]) is None
