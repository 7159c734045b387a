"""A draft model swapped without downtime: the coordinator keeps what it learnt of a draft (α,
b, step costs) per model fingerprint, so a new model behind the same address starts from its
own rounds, never its predecessor's, and the old model's estimates stay as they were.

Here the unit tests; the other tiers' are in tests/e2e/test_draft_swap.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.policy.speculation import Speculation
from coordinator.sessions.routing import model_fingerprint
from specdec.types import ModelDescription, Source

DRAFT = Source.DRAFT


def _rounds(spec, accepted: int, count: int = 4) -> None:
    for _ in range(count):
        spec.observe(DRAFT, 4, accepted, propose_seconds=0.004, verify_seconds=0.01, verified_tokens=5)


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


def test_the_fingerprint_names_the_model_not_the_replica():
    info = ModelDescription("models/draft-v1", 32, "fp", 32, (0,), 512, "bfloat16", "cpu", 16)
    assert model_fingerprint(info) == model_fingerprint(dataclasses.replace(info, tokenizer_fingerprint="other"))
    for change in ({"model_id": "models/draft-v2"}, {"dtype": "float32"}, {"device": "cuda:0"}, {"vocab_size": 64},
                   {"checkpoint_id": "another"}):  # the last: a checkpoint written over the same path
        assert model_fingerprint(dataclasses.replace(info, **change)) != model_fingerprint(info)
