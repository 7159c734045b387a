"""A draft model swapped without downtime: the coordinator keeps what it learnt of a draft (α,
b, step costs) per model fingerprint, so a new model behind the same address starts from its
own rounds, never its predecessor's, and the old model's estimates stay as they were."""

from __future__ import annotations

import dataclasses
import time

import pytest

from coordinator.policy.speculation import Speculation
from coordinator.sessions.routing import model_fingerprint
from specdec.types import ModelDescription, Source
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster

DRAFT = Source.DRAFT


def _rounds(spec, accepted: int, count: int = 4) -> None:
    for _ in range(count):
        spec.observe(DRAFT, 4, accepted, propose_seconds=0.004, verify_seconds=0.01, verified_tokens=5)


@pytest.mark.unit
def test_estimates_are_kept_per_draft_model():
    speculation = Speculation(8, 4, draft_model="A")
    on_a = speculation.start("s", DRAFT, None, draft_model="A")
    _rounds(on_a, accepted=4)
    a = speculation.estimates("A")
    assert a.acceptance.alpha == 1.0 and a.costs.propose[DRAFT].w > 0
    # the session's next request finds its replica serving B: it forgets what it learnt of A
    on_b = speculation.start("s", DRAFT, None, draft_model="B")
    b = speculation.estimates("B")
    assert on_b.policy.alpha(DRAFT) is None and on_b.policy.draft_model == "B"
    assert b.acceptance.rounds == 0 and b.costs.propose[DRAFT].w == 0
    assert b.costs.verify is a.costs.verify  # the target's costs are the target's
    _rounds(on_b, accepted=0)
    assert b.acceptance.alpha == 0.0 and a.acceptance.alpha == 1.0 and a.acceptance.rounds == 4
    # a new session on A (old replicas still serve during a rolling update) starts from A's α
    assert speculation.start("t", DRAFT, None, draft_model="A").policy.alpha(DRAFT) == pytest.approx(1.0)
    # mid-request: the request plans with B's estimates from its next round on
    moving = speculation.start("u", DRAFT, None, draft_model="A")
    speculation.use_draft_model(moving, "B")
    assert moving.policy.alpha(DRAFT) == pytest.approx(0.0) and moving.priors[DRAFT] is b.acceptance


@pytest.mark.unit
def test_the_fingerprint_names_the_model_not_the_replica():
    info = ModelDescription("models/draft-v1", 32, "fp", 32, (0,), 512, "bfloat16", "cpu", 16)
    assert model_fingerprint(info) == model_fingerprint(dataclasses.replace(info, tokenizer_fingerprint="other"))
    for change in ({"model_id": "models/draft-v2"}, {"dtype": "float32"}, {"device": "cuda:0"}, {"vocab_size": 64},
                   {"checkpoint_id": "another"}):  # the last: a checkpoint written over the same path
        assert model_fingerprint(dataclasses.replace(info, **change)) != model_fingerprint(info)


def _wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.e2e
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
