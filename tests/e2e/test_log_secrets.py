"""Session ids are bearer secrets: logs at INFO and above never contain them, only a tag.

Here the e2e tests; the other tiers' are in tests/unit/test_log_secrets.py.
"""

from __future__ import annotations

import logging

from specdec.logtag import session_tag
from tests.cluster import Cluster


def test_session_ids_never_reach_info_logs(models, caplog):
    caplog.set_level(logging.INFO)
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 target={"max_sessions": 1}) as cluster:
        first = cluster.complete(prompt="def fibonacci(n):", max_new_tokens=4, ignore_eos=True)
        cluster.restart_target()  # the next request of the session is a target cache miss
        again = cluster.complete(session_id=first.session_id, prompt=" more", max_new_tokens=4,
                                 ignore_eos=True)
        assert again.stats.cache_misses >= 1
        other = cluster.complete(prompt="The quick", max_new_tokens=4, ignore_eos=True)  # evicts the first
    messages = [record.getMessage() for record in caplog.records]
    for secret in (first.session_id, other.session_id):
        assert len(secret) >= 16
        assert not [m for m in messages if secret in m]
        assert secret not in caplog.text
    # the events were logged, naming the session by its tag
    tag = session_tag(first.session_id)
    assert any("cache miss" in m and tag in m for m in messages), messages
    assert any("evicted" in m and tag in m for m in messages), messages
