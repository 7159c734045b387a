"""Prometheus metrics: a real /metrics endpoint on an ephemeral port, scraped over HTTP.

Here the unit tests; the other tiers' are in tests/service/test_metrics.py.
"""

from __future__ import annotations

import argparse

import pytest

from specdec.config import CoordinatorConfig, DraftConfig, TargetConfig, add_arguments, from_sources
from specdec.metrics import Metrics


def test_registries_are_per_service():
    coordinator, target = Metrics("coordinator"), Metrics("target")
    coordinator.record_round("draft", 2, 2)
    assert coordinator.registry.get_sample_value("specdec_num_draft_tokens_total",
                                                 {"proposer": "draft"}) == 2
    assert target.registry.get_sample_value("specdec_num_draft_tokens_total",
                                            {"proposer": "draft"}) is None
    assert b"specdec_num_draft_tokens_total" in coordinator.render()


def test_bad_labels_are_refused():
    metrics = Metrics("draft")
    with pytest.raises(ValueError, match="proposer"):
        metrics.record_round("eagle", 2, 1)
    with pytest.raises(ValueError, match="accepted"):
        metrics.record_round("draft", 2, 3)
    with pytest.raises(ValueError, match="stage"):
        metrics.observe_stage("detokenize", 0.1)
    with pytest.raises(ValueError, match="service"):
        Metrics("router")


@pytest.mark.parametrize("cls, prefix", [(CoordinatorConfig, "coordinator"),
                                         (DraftConfig, "draft"), (TargetConfig, "target")])
def test_every_service_has_a_metrics_port_flag(cls, prefix):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, prefix)
    assert from_sources(cls, prefix, vars(parser.parse_args([])), {}).metrics_port == 0
    env = {f"SPECDEC_{prefix.upper()}_METRICS_PORT": "9090"}
    assert from_sources(cls, prefix, vars(parser.parse_args([])), env).metrics_port == 9090
    assert from_sources(cls, prefix, vars(parser.parse_args(["--metrics-port", "9100"])),
                        env).metrics_port == 9100


def test_token_times_give_the_time_to_first_token_and_per_output_token():
    from coordinator.rounds import TokenTimes

    times = TokenTimes(arrived=10.0)
    assert times.streamed(0, 10.5) is None  # a chunk without tokens (a stop string held back)
    assert times.streamed(3, 11.0) == 1.0  # the first tokens: 1 s after arrival
    assert times.streamed(2, 12.0) is None
    assert times.streamed(0, 15.0) is None and times.per_output_token() == (12.0 - 11.0) / (5 - 1)
    one = TokenTimes(arrived=0.0)
    one.streamed(1, 1.0)
    assert one.per_output_token() is None  # a single token has no time per output token
