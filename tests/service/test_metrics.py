"""Prometheus metrics: a real /metrics endpoint on an ephemeral port, scraped over HTTP.

Here the service tests; the other tiers' are in tests/unit/test_metrics.py.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.metrics import Metrics, serve_metrics


def scrape(port: int) -> dict:
    """{(sample name, sorted labels): value} from GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def served_metrics():
    metrics = Metrics("coordinator")
    server = metrics.serve(0)
    yield metrics, server
    server.stop()


def test_rounds_move_the_counters_by_exactly_what_was_recorded(served_metrics):
    metrics, server = served_metrics
    metrics.record_round("draft", 3, 2, {"draft": 0.002, "verify": 0.015})  # earlier traffic
    before = scrape(server.port)
    metrics.record_round("draft", 4, 3, {"draft": 0.004, "verify": 0.020, "coordinator": 0.0005})
    metrics.record_round("draft", 4, 0, {"draft": 0.003, "verify": 0.018})
    metrics.record_round("ngram", 5, 5, {"verify": 0.030, "store": 0.001})
    metrics.record_round("none", 0, 0, {"verify": 0.010})
    after = scrape(server.port)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("specdec_num_drafts_total", proposer="draft") == 2
    assert moved("specdec_num_drafts_total", proposer="ngram") == 1
    assert moved("specdec_num_drafts_total", proposer="none") == 0
    assert moved("specdec_num_draft_tokens_total", proposer="draft") == 8
    assert moved("specdec_num_draft_tokens_total", proposer="ngram") == 5
    assert moved("specdec_num_accepted_tokens_total", proposer="draft") == 3
    assert moved("specdec_num_accepted_tokens_total", proposer="ngram") == 5
    per_pos = [moved("specdec_num_accepted_tokens_per_pos_total", proposer="draft", position=str(i))
               for i in range(5)]
    assert per_pos == [1, 1, 1, 0, 0]
    assert value(after, "specdec_num_accepted_tokens_per_pos_total", proposer="draft",
                 position="0") == 2
    assert moved("specdec_num_accepted_tokens_per_pos_total", proposer="ngram", position="4") == 1

    assert moved("specdec_round_latency_seconds_count", stage="verify") == 4
    assert moved("specdec_round_latency_seconds_sum", stage="verify") == pytest.approx(0.078)
    assert moved("specdec_round_latency_seconds_count", stage="draft") == 2
    assert moved("specdec_round_latency_seconds_count", stage="store") == 1
    assert moved("specdec_round_latency_seconds_count", stage="coordinator") == 1
    assert moved("specdec_round_latency_seconds_bucket", stage="verify", le="0.025") == 3
    assert moved("specdec_round_latency_seconds_bucket", stage="verify", le="0.01") == 1
    # γ per round and tokens per round (accepted + 1)
    assert moved("specdec_num_speculative_tokens_sum", proposer="draft") == 8
    assert moved("specdec_num_speculative_tokens_count", proposer="none") == 1
    assert moved("specdec_tokens_per_round_sum", proposer="draft") == 5
    assert moved("specdec_tokens_per_round_sum", proposer="ngram") == 6
    assert moved("specdec_tokens_per_round_bucket", proposer="ngram", le="5.0") == 0
    info = [(dict(labels), v) for (name, labels), v in after.items()
            if name == "specdec_service_info"]
    assert len(info) == 1 and info[0][0]["service"] == "coordinator" and info[0][1] == 1


def test_requests_gauges_and_batches(served_metrics):
    coordinator, coordinator_server = served_metrics
    metrics = Metrics("target")
    server = metrics.serve(0)
    metrics.record_request("Generate", grpc.StatusCode.OK)
    metrics.record_request("Generate", grpc.StatusCode.OK)
    metrics.record_request("Generate", grpc.StatusCode.INVALID_ARGUMENT)
    metrics.record_request("Generate", "UNAVAILABLE")
    for size in (1, 3, 16):
        metrics.observe_batch(size)
    metrics.watch(cached_sessions=lambda: 7, kv_cache_bytes=lambda: 123_456, queue_depth=lambda: 2)
    with coordinator.active():
        inside = scrape(coordinator_server.port)
    after = scrape(server.port)
    coordinator_after = scrape(coordinator_server.port)
    server.stop()

    assert value(after, "specdec_requests_total", method="Generate", code="OK") == 2
    assert value(after, "specdec_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert value(after, "specdec_requests_total", method="Generate", code="UNAVAILABLE") == 1
    assert value(after, "specdec_batch_size_count") == 3
    assert value(after, "specdec_batch_size_sum") == 20
    assert value(after, "specdec_batch_size_bucket", le="2.0") == 1
    assert value(after, "specdec_cached_sessions") == 7
    assert value(after, "specdec_kv_cache_bytes") == 123_456
    assert value(after, "specdec_queue_depth") == 2
    assert value(inside, "specdec_active_sessions") == 1
    assert value(coordinator_after, "specdec_active_sessions") == 0
    # each service exports only what it measures
    assert ("specdec_active_sessions", ()) not in after
    assert not [name for name, _ in coordinator_after if name.startswith(("specdec_batch_size", "specdec_queue"))]


def test_serve_metrics_is_off_at_port_zero_and_stops_cleanly():
    metrics = Metrics("target")
    assert serve_metrics(metrics, 0) is None
    with pytest.raises(ValueError):
        serve_metrics(metrics, -1)
    probe = metrics.serve(0)        # find a free port, then serve on it through the hook
    port = probe.port
    probe.stop()
    server = serve_metrics(metrics, port)
    try:
        assert server.port == port
        assert ("specdec_kv_cache_bytes", ()) in scrape(port)
    finally:
        server.stop()
    assert not server.thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
