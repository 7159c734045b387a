"""A draft model swapped without downtime: the coordinator keeps what it learnt of a draft (α,
b, step costs) per model fingerprint, so a new model behind the same address starts from its
own rounds, never its predecessor's, and the old model's estimates stay as they were.

Here the e2e tests; the other tiers' are in tests/unit/test_draft_swap.py.
"""

from __future__ import annotations

import dataclasses
import time

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster


def _wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_draft_restarted_with_another_model_behind_the_same_address(models, monkeypatch):
    """Two draft servers with different models on one address in turn (a rolling restart seen
    from static discovery): the replica's new model is noticed, its α is measured from scratch,
    the old model's estimates are left as they were, and the output never changes."""
    monkeypatch.setattr("coordinator.sessions.routing.INFO_REFRESH_S", 0.2)
    target = models["llama"]["target"]
    request = dict(prompt="def fibonacci(n):", max_new_tokens=24, ignore_eos=True,
                   proposer=coordinator_pb2.Proposer.Value("PROPOSER_DRAFT"), num_speculative_tokens=3)
    with Cluster(models["llama"]["draft"], target) as cluster:
        loop = cluster.coordinator.round_loop
        old = loop.speculation.draft_model
        first = cluster.complete(**request)
        old_alpha = loop.speculation.estimates(old).acceptance.alpha
        old_rounds = loop.speculation.estimates(old).acceptance.rounds
        assert old_rounds > 0 and old_alpha < 0.9  # an unrelated draft
        address = f"127.0.0.1:{cluster.draft_port}"
        cluster.draft_config = dataclasses.replace(cluster.draft_config, model=target)  # the target as draft
        cluster.restart_draft()
        _wait_for(lambda: loop.routes.drafts.model_of(address) not in (None, old))  # read again, no call failed
        new = loop.routes.drafts.model_of(address)
        again = cluster.complete(session_id=first.session_id, **{**request, "prompt": " # again"})
        assert again.stats.acceptance_rate == 1.0
        assert loop.speculation.draft_model == new != old
        assert loop.speculation.estimates(new).acceptance.alpha == 1.0
        assert loop.speculation.estimates(old).acceptance.rounds == old_rounds  # untouched
        assert loop.speculation.policy(first.session_id).draft_model == new
        assert list(cluster.complete(**request).token_ids) == list(first.token_ids)
