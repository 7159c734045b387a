"""The coordinator's rounds reach the metrics in flushes (specdec/metrics.py's record_round and
flush_rounds): what a scrape shows is what one observe and inc per round would have shown."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from specdec import metrics as metrics_module
from specdec.metrics import LATENCY_BUCKETS, Metrics, observe_all

pytestmark = pytest.mark.unit


def _samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


def test_observe_all_fills_the_buckets_and_sum_as_observe_does():
    values = [0.0, 0.0005, 0.0007, 0.001, 0.3, 7.0, 1e9, float("nan")]
    one, many = CollectorRegistry(), CollectorRegistry()
    single = Histogram("h", "h", buckets=LATENCY_BUCKETS, registry=one)
    batched = Histogram("h", "h", buckets=LATENCY_BUCKETS, registry=many)
    for value in values:
        single.observe(value)
    observe_all(batched, [(v, 1) for v in values])
    got, want = _samples(many), _samples(one)
    assert {k: v for k, v in got.items() if k[0] != "h_sum"} == {k: v for k, v in want.items() if k[0] != "h_sum"}
    assert str(got["h_sum", ()]) == str(want["h_sum", ()]) == "nan"
    thrice, once = Histogram("t", "t", buckets=LATENCY_BUCKETS, registry=None), Histogram("t", "t", buckets=LATENCY_BUCKETS, registry=None)
    observe_all(thrice, [(0.3, 3), (0.0001, 2)])
    for value in (0.3, 0.3, 0.3, 0.0001, 0.0001):
        once.observe(value)
    values = [[s.value for s in h.collect()[0].samples if not s.name.endswith("_created")] for h in (thrice, once)]
    assert values[0] == pytest.approx(values[1])


def _per_round(metrics: Metrics, proposer, gamma, accepted, stages, tree) -> None:
    """What record_round did before its rounds were flushed: every update at once."""
    child = metrics._child
    if gamma > 0:
        child(metrics.num_drafts, proposer).inc()
        child(metrics.num_draft_tokens, proposer).inc(gamma)
        child(metrics.num_accepted_tokens, proposer).inc(accepted)
        for position in range(accepted):
            child(metrics.num_accepted_tokens_per_pos, proposer, str(position)).inc()
    if tree and gamma > 0:
        metrics.num_tree_drafts.inc()
        metrics.num_tree_draft_tokens.inc(gamma)
        for depth in range(1, accepted + 1):
            child(metrics.num_tree_accepted_tokens_per_depth, str(depth)).inc()
        metrics.tree_tokens_per_round.observe(accepted + 1)
    child(metrics.num_speculative_tokens, proposer).observe(gamma)
    child(metrics.tokens_per_round, proposer).observe(accepted + 1)
    for stage, seconds in stages.items():
        metrics.observe_stage(stage, seconds)


@pytest.mark.parametrize("rounds", [1, 63, 64, 200])
def test_a_scrape_shows_every_round_recorded_flushed_or_not(rounds):
    rng = random.Random(rounds)
    flushed, direct = Metrics("coordinator", "v"), Metrics("coordinator", "v")
    for _ in range(rounds):
        proposer = rng.choice(["draft", "ngram", "none", "heads"])
        gamma = 0 if proposer == "none" else rng.randint(0, 8)
        accepted = rng.randint(0, gamma)
        stages = {s: rng.random() / 50 for s in ("draft", "verify", "store", "coordinator") if rng.random() < 0.8}
        tree = proposer == "draft" and rng.random() < 0.3
        flushed.record_round(proposer, gamma, accepted, stages, tree=tree)
        _per_round(direct, proposer, gamma, accepted, stages, tree)
    got, want = _samples(flushed.registry), _samples(direct.registry)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert len(flushed._rounds) == 0  # the scrape flushed them


def test_rounds_wait_until_a_flush_and_bad_rounds_fail_when_recorded(monkeypatch):
    monkeypatch.setattr(metrics_module, "ROUNDS_PER_FLUSH", 3)
    metrics = Metrics("coordinator", "v")
    metrics.record_round("draft", 4, 2)
    metrics.record_round("draft", 4, 4)
    assert metrics._child(metrics.num_drafts, "draft")._value.get() == 0  # not yet added
    metrics.record_round("draft", 4, 1)  # the third: flushed
    assert metrics._child(metrics.num_drafts, "draft")._value.get() == 3
    for bad in (("auto", 4, 1, None), ("draft", 2, 3, None), ("draft", 4, 1, {"prefill": 0.1})):
        with pytest.raises(ValueError):
            metrics.record_round(*bad)
    assert metrics._rounds == []
