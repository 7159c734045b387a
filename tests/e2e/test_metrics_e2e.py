"""The three services' /metrics endpoints, scraped over HTTP around real generations: the
counters move exactly as the returned stats say."""

from __future__ import annotations

import json
import pathlib
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster, _free_port
from tests.service.test_metrics import scrape, value


@pytest.fixture(scope="module")
def metered(small_vocab_models):
    ports = {name: _free_port() for name in ("coordinator", "draft", "target")}
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"],
                 coordinator={"metrics_port": ports["coordinator"], "http_port": -1},
                 draft={"metrics_port": ports["draft"]},
                 target={"metrics_port": ports["target"]}) as cluster:
        yield cluster, ports


@pytest.fixture(scope="module")
def metered_kv_store(small_vocab_models):
    """The same with a KV store behind the draft and the target: the specdec_kv_store_* families."""
    ports = {name: _free_port() for name in ("coordinator", "draft", "target")}
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"],
                 coordinator={"metrics_port": ports["coordinator"]},
                 draft={"metrics_port": ports["draft"], "kv_store": "memory://"},
                 target={"metrics_port": ports["target"], "kv_store": "memory://"}) as cluster:
        cluster.complete(token_ids=[3, 7, 5, 3, 7], max_new_tokens=8, ignore_eos=True)
        yield cluster, ports


OPERATIONS_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented_families() -> list[tuple[set[str], set[str], bool]]:
    """docs/operations.md's metrics table: (family names, services, only with --kv-store) per row."""
    rows = []
    for line in OPERATIONS_MD.read_text().splitlines():
        if not line.startswith("| `specdec_"):
            continue
        metric, services = line.split("|")[1:3]
        names = set(re.findall(r"`(specdec_\w+)`", metric))
        named = set(re.findall(r"\b(coordinator|draft|target|all)\b", services))
        rows.append((names, {"coordinator", "draft", "target"} if "all" in named else named,
                     "--kv-store" in services))
    assert rows, "docs/operations.md has no metrics table"
    return rows


def expected_families(service: str, kv_store: bool) -> set[str]:
    return {name for names, services, store_only in documented_families()
            if service in services and (kv_store or not store_only) for name in names}


def exposition(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def exported_families(port: int) -> set[str]:
    """The family names GET /metrics declares (# TYPE lines), less prometheus_client's own
    `_created` timestamps."""
    return {line.split()[2] for line in exposition(port).splitlines()
            if line.startswith("# TYPE ") and not line.split()[2].endswith("_created")}


def check_documented(ports: dict, kv_store: bool) -> None:
    for service, port in ports.items():
        exported, documented = exported_families(port), expected_families(service, kv_store)
        assert exported == documented, (
            f"{service}: exported but not in docs/operations.md's table for it: {sorted(exported - documented)}; "
            f"documented but not exported: {sorted(documented - exported)}")


def scrape_all(ports: dict) -> dict:
    return {name: scrape(port) for name, port in ports.items()}


def moved(before: dict, after: dict, service: str, name: str, **labels) -> float:
    return value(after[service], name, **labels) - value(before[service], name, **labels)


def test_counters_move_with_the_returned_stats(metered):
    cluster, ports = metered
    before = scrape_all(ports)
    started = time.monotonic()
    response = cluster.complete(token_ids=[3, 7, 5, 3, 7, 5, 3, 7], max_new_tokens=48, ignore_eos=True,
                                proposer=coordinator_pb2.PROPOSER_AUTO)
    elapsed = time.monotonic() - started
    after = scrape_all(ports)
    stats = response.stats
    assert stats.draft_rounds > 0 and stats.ngram_rounds > 0  # both proposers took part

    def coordinator(name: str, **labels) -> float:
        return moved(before, after, "coordinator", name, **labels)

    draft_tokens = stats.draft_tokens - stats.ngram_draft_tokens
    draft_accepted = stats.accepted_tokens - stats.ngram_accepted_tokens
    assert coordinator("specdec_num_drafts_total", proposer="draft") == stats.draft_rounds
    assert coordinator("specdec_num_drafts_total", proposer="ngram") == stats.ngram_rounds
    assert coordinator("specdec_num_draft_tokens_total", proposer="draft") == draft_tokens
    assert coordinator("specdec_num_draft_tokens_total", proposer="ngram") == stats.ngram_draft_tokens
    assert coordinator("specdec_num_accepted_tokens_total", proposer="draft") == draft_accepted
    assert coordinator("specdec_num_accepted_tokens_total", proposer="ngram") == stats.ngram_accepted_tokens
    per_position = [sum(coordinator("specdec_num_accepted_tokens_per_pos_total", proposer=p, position=str(i))
                        for p in ("draft", "ngram"))
                    for i in range(len(stats.accepted_per_position))]
    assert per_position == list(stats.accepted_per_position)
    rounds = sum(coordinator("specdec_num_speculative_tokens_count", proposer=p)
                 for p in ("draft", "ngram", "none"))
    assert rounds == stats.rounds
    assert coordinator("specdec_num_speculative_tokens_count", proposer="none") == stats.rounds_by_gamma[0]
    assert sum(coordinator("specdec_num_speculative_tokens_sum", proposer=p)
               for p in ("draft", "ngram")) == stats.draft_tokens
    # every round commits accepted + 1 tokens; all of them count here (no stop, EOS ignored)
    assert sum(coordinator("specdec_tokens_per_round_sum", proposer=p)
               for p in ("draft", "ngram", "none")) == stats.generated_tokens
    for stage in ("verify", "store", "coordinator"):
        assert coordinator("specdec_round_latency_seconds_count", stage=stage) == stats.rounds
    assert coordinator("specdec_round_latency_seconds_count", stage="draft") == stats.draft_rounds
    assert coordinator("specdec_requests_total", method="Complete", code="OK") == 1
    # one generation: one time to first token, one time per output token, within its own duration
    assert coordinator("specdec_time_to_first_token_seconds_count") == 1
    assert coordinator("specdec_time_per_output_token_seconds_count") == 1
    assert 0 < coordinator("specdec_time_to_first_token_seconds_sum") < elapsed
    assert 0 < coordinator("specdec_time_per_output_token_seconds_sum") * (stats.generated_tokens - 1) < elapsed
    assert value(after["coordinator"], "specdec_active_sessions") == 0

    # the draft was called once per draft round, the target once per round
    assert moved(before, after, "draft", "specdec_requests_total", method="Propose", code="OK") \
        == stats.draft_rounds
    assert moved(before, after, "draft", "specdec_round_latency_seconds_count", stage="draft") \
        == stats.draft_rounds
    assert moved(before, after, "target", "specdec_requests_total", method="Verify", code="OK") == stats.rounds
    assert moved(before, after, "target", "specdec_round_latency_seconds_count", stage="verify") \
        == stats.rounds
    # one request alone: every batch holds one call (one per verification, one per draft round)
    assert moved(before, after, "target", "specdec_batch_size_count") == stats.rounds
    assert moved(before, after, "target", "specdec_batch_size_sum") == stats.rounds
    assert moved(before, after, "draft", "specdec_batch_size_count") >= stats.draft_rounds
    for service in ("draft", "target"):
        assert value(after[service], "specdec_cached_sessions") >= 1
        assert value(after[service], "specdec_kv_cache_bytes") > 0
        assert value(after[service], "specdec_queue_depth") == 0
        info = [labels for (name, labels), _ in after[service].items() if name == "specdec_service_info"]
        assert dict(info[0])["service"] == service


def test_prompt_lookup_makes_no_draft_call_and_errors_count_by_code(metered):
    cluster, ports = metered
    before = scrape_all(ports)
    response = cluster.complete(token_ids=[1, 2, 9, 4, 1, 2, 9], max_new_tokens=32, ignore_eos=True,
                                proposer=coordinator_pb2.PROPOSER_NGRAM)
    with pytest.raises(grpc.RpcError) as info:
        cluster.complete(token_ids=[1, 2], max_new_tokens=0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError):
        cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id="no-such-session"), timeout=10)
    # an aborted call's status reaches the client a moment before the server counts it: scrape
    # until both errors are counted (or 5 s pass: the asserts below then say which is missing)
    give_up = time.monotonic() + 5
    while True:
        after = scrape_all(ports)
        counted = [moved(before, after, "coordinator", "specdec_requests_total", method=method, code=code)
                   for method, code in (("Complete", "INVALID_ARGUMENT"), ("GetSession", "NOT_FOUND"))]
        if min(counted) >= 1 or time.monotonic() > give_up:
            break
        time.sleep(0.05)
    assert response.stats.ngram_rounds > 0 and response.stats.ngram_accepted_tokens > 0
    assert moved(before, after, "draft", "specdec_requests_total", method="Propose", code="OK") == 0
    assert moved(before, after, "coordinator", "specdec_num_drafts_total", proposer="draft") == 0
    assert moved(before, after, "coordinator", "specdec_num_accepted_tokens_total", proposer="ngram") \
        == response.stats.ngram_accepted_tokens
    assert moved(before, after, "target", "specdec_requests_total", method="Verify", code="OK") \
        == response.stats.rounds
    assert moved(before, after, "coordinator", "specdec_requests_total", method="Complete",
                 code="INVALID_ARGUMENT") == 1
    assert moved(before, after, "coordinator", "specdec_requests_total", method="GetSession",
                 code="NOT_FOUND") == 1
    assert moved(before, after, "coordinator", "specdec_requests_total", method="Complete", code="OK") == 1


def test_streamed_generation_counts_once_and_health_is_not_counted(metered):
    cluster, ports = metered
    before = scrape_all(ports)
    chunks = cluster.stream(token_ids=[3, 7, 5], max_new_tokens=6, ignore_eos=True)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health_pb2_grpc.HealthStub(cluster.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    after = scrape_all(ports)
    assert chunks[-1].stats.generated_tokens == 6
    assert moved(before, after, "coordinator", "specdec_requests_total", method="Generate", code="OK") == 1
    assert not [key for key in after["coordinator"] if key[0] == "specdec_requests_total"
                and dict(key[1]).get("method") == "Check"]
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['coordinator']}/metrics", timeout=5) as page:
        assert page.headers["Content-Type"].startswith("text/plain")


def test_each_service_exports_exactly_the_documented_families(metered):
    cluster, ports = metered
    cluster.complete(token_ids=[3, 7, 5, 3, 7], max_new_tokens=8, ignore_eos=True)  # every family has moved
    check_documented(ports, kv_store=False)


def test_the_kv_store_families_appear_with_a_kv_store(metered_kv_store):
    _, ports = metered_kv_store
    check_documented(ports, kv_store=True)


def test_http_calls_count_by_route_and_status(metered):
    cluster, ports = metered
    base = f"http://127.0.0.1:{cluster.coordinator.http_port}"
    before = scrape_all(ports)
    body = json.dumps({"model": cluster.coordinator.served_model_names[0], "prompt": [3, 7, 5],
                       "max_tokens": 4, "temperature": 0}).encode()
    post = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=30) as response:
        assert response.status == 200
    for url, data in ((f"{base}/v1/completions", b"{not json"), (f"{base}/v1/nowhere", None)):
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(url, data, {"Content-Type": "application/json"}), timeout=30)
    after = scrape_all(ports)
    counted = {(path, status): moved(before, after, "coordinator", "specdec_http_requests_total",
                                     path=path, status=status)
               for path, status in (("/v1/completions", "200"), ("/v1/completions", "400"), ("unmatched", "404"))}
    assert counted == {key: 1 for key in counted}
    assert moved(before, after, "coordinator", "specdec_time_to_first_token_seconds_count") == 1  # both APIs


def test_the_dashboard_names_only_series_the_services_export(metered, metered_kv_store):
    """Every series name in every query of helm/specdec/dashboards/specdec.json is one a running
    service exposes (on /metrics, scraped here from both clusters, with and without a KV store)."""
    from tests.unit.test_dashboard import exportable_series, load_dashboard, queries, series_names

    exported = set()
    for cluster, ports in (metered, metered_kv_store):
        cluster.complete(token_ids=[3, 7, 5, 3, 7], max_new_tokens=8, ignore_eos=True)
        for port in ports.values():
            exported |= exportable_series(exposition(port))
    unknown = {(title, name) for title, expr in queries(load_dashboard())
               for name in series_names(expr) if name not in exported}
    assert not unknown, f"panels query series no service exports: {sorted(unknown)}"
