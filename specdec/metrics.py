"""Prometheus metrics, one module for all three services.

Each service builds one ``Metrics(service)``: its own ``CollectorRegistry`` (no global
registry state, so several services or tests can live in one process) served on
``--metrics-port`` by ``serve_metrics``. Names follow vLLM's speculative-decoding metrics with
the prefix ``specdec_``; counters are exposed with the ``_total`` suffix
(``specdec_num_drafts_total``), histograms with ``_bucket`` / ``_sum`` / ``_count``.

A service records and exports only what it sees (FAMILIES): the coordinator rounds, γ,
requests and their latency (time to first token, time per output token as vLLM's
benchmark_serving defines them); the draft and target their stage latency, batch sizes and caches. docs/operations.md's
metrics table says the same, checked against live services by tests/test_metrics_e2e.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import generate_latest, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from specdec.types import Source

SERVICES = ("coordinator", "draft", "target")
ROUND_SOURCES = tuple(p.value for p in Source if p != Source.AUTO)  # a round's proposer label
STAGES = ("draft", "verify", "store", "coordinator")
WATCHABLE = ("active_sessions", "cached_sessions", "kv_cache_bytes", "queue_depth")
# the K/V chunk metrics of a draft or target service (read from its engine's KV tier when scraped)
KV_CHUNK_COUNTERS = {
    "specdec_kv_restored_tokens": "history tokens loaded from K/V chunks instead of prefilled",
    "specdec_kv_prefix_cache_hits": "K/V chunks found in this replica's prefix cache",
    "specdec_kv_store_hits": "K/V chunks read from the KV store",
    "specdec_kv_store_misses": "K/V chunks looked up in the KV store and not found",
    "specdec_kv_chunks_rejected": "K/V chunks found but unusable (corrupt, another layout or model)",
    "specdec_kv_restore_seconds": "time spent looking K/V chunks up and loading them",
    "specdec_kv_chunks_kept": "K/V chunks of committed history copied out after calls",
    "specdec_kv_store_bytes_read": "bytes of K/V chunks read from the KV store",
    "specdec_kv_store_bytes_written": "bytes of K/V chunks written to the KV store",
    "specdec_kv_store_chunks_written": "K/V chunks written to the KV store",
    "specdec_kv_store_writes_skipped": "K/V chunks not written: the writer's queue was full",
    "specdec_kv_store_writes_failed": "K/V chunks not written: the store failed",
}
KV_CHUNK_GAUGES = {
    "specdec_kv_store_up": "1 while the KV store answers, 0 while reads skip it",
    "specdec_kv_prefix_cache_bytes": "bytes held by this replica's prefix cache",
}

MODEL_SERVICES = ("draft", "target")
# the metric families each service exports (the K/V chunk ones come from its K/V tier, when it has one)
FAMILIES: dict[str, tuple[str, ...]] = {
    "specdec_service": SERVICES,
    "specdec_requests": SERVICES,
    "specdec_http_requests": ("coordinator",),
    "specdec_round_latency_seconds": SERVICES,
    "specdec_num_drafts": ("coordinator",),
    "specdec_num_draft_tokens": ("coordinator",),
    "specdec_num_accepted_tokens": ("coordinator",),
    "specdec_num_accepted_tokens_per_pos": ("coordinator",),
    "specdec_num_tree_drafts": ("coordinator",),
    "specdec_num_tree_draft_tokens": ("coordinator",),
    "specdec_num_tree_accepted_tokens_per_depth": ("coordinator",),
    "specdec_tree_tokens_per_round": ("coordinator",),
    "specdec_tokens_per_round": ("coordinator",),
    "specdec_num_speculative_tokens": ("coordinator",),
    "specdec_active_sessions": ("coordinator",),
    "specdec_time_to_first_token_seconds": ("coordinator",),
    "specdec_time_per_output_token_seconds": ("coordinator",),
    "specdec_batch_size": MODEL_SERVICES,
    "specdec_cached_sessions": MODEL_SERVICES,
    "specdec_kv_cache_bytes": MODEL_SERVICES,
    "specdec_queue_depth": MODEL_SERVICES,
}
KV_STORE_PREFIX = "specdec_kv_store_"  # K/V chunk families of the KV store: exported only with one

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
REQUEST_LATENCY_BUCKETS = LATENCY_BUCKETS + (60.0, 120.0)  # a request's first token may wait for a long prefill
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)


@dataclass
class MetricsServer:
    """A running /metrics endpoint; `stop()` shuts it down and joins its thread."""

    server: Any
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Metrics:
    """The metrics of one service, in a registry of its own."""

    def __init__(self, service: str, version: str = "") -> None:
        if service not in SERVICES:
            raise ValueError(f"service must be one of {', '.join(SERVICES)}, got {service!r}")
        self.service = service
        self.registry = CollectorRegistry()
        # every family is built (recording is the same call in every service); only the
        # service's own are registered, so /metrics shows nothing stuck at 0 (FAMILIES)
        self.service_info = Info("specdec_service", "the service exposing these metrics", registry=None)
        self.service_info.info({"service": service, "version": version or _version()})
        by_proposer = ["proposer"]
        self.num_drafts = Counter("specdec_num_drafts", "rounds that proposed at least one token",
                                  by_proposer, registry=None)
        self.num_draft_tokens = Counter("specdec_num_draft_tokens", "tokens proposed",
                                        by_proposer, registry=None)
        self.num_accepted_tokens = Counter("specdec_num_accepted_tokens",
                                           "proposed tokens the target accepted", by_proposer,
                                           registry=None)
        self.num_accepted_tokens_per_pos = Counter(
            "specdec_num_accepted_tokens_per_pos",
            "accepted proposals by position in the round (0 = the first proposed token)",
            ["proposer", "position"], registry=None)
        self.num_tree_drafts = Counter("specdec_num_tree_drafts", "draft-model rounds that proposed a token tree",
                                       registry=None)
        self.num_tree_draft_tokens = Counter("specdec_num_tree_draft_tokens", "nodes of the token trees proposed",
                                             registry=None)
        self.num_tree_accepted_tokens_per_depth = Counter(
            "specdec_num_tree_accepted_tokens_per_depth",
            "tree rounds whose accepted path reached this depth (1 = the root's child)", ["depth"], registry=None)
        self.tree_tokens_per_round = Histogram("specdec_tree_tokens_per_round",
                                               "tokens a tree round committed per target pass (path + 1)",
                                               buckets=TOKEN_BUCKETS, registry=None)
        self.requests = Counter("specdec_requests", "finished gRPC calls by method and status code",
                                ["method", "code"], registry=None)
        self.http_requests = Counter("specdec_http_requests",
                                     "finished calls of the OpenAI-compatible HTTP API by route and status",
                                     ["path", "status"], registry=None)
        self.round_latency = Histogram("specdec_round_latency_seconds",
                                       "time a round spent per stage", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=None)
        self.batch_size = Histogram("specdec_batch_size", "sessions per model forward pass",
                                    buckets=BATCH_BUCKETS, registry=None)
        self.tokens_per_round = Histogram("specdec_tokens_per_round",
                                          "tokens committed per round (accepted + 1)",
                                          by_proposer, buckets=TOKEN_BUCKETS, registry=None)
        self.num_speculative_tokens = Histogram("specdec_num_speculative_tokens",
                                                "γ chosen per round", by_proposer,
                                                buckets=TOKEN_BUCKETS, registry=None)
        self.time_to_first_token = Histogram(
            "specdec_time_to_first_token_seconds",
            "from a generation's arrival to its first token leaving the coordinator",
            buckets=REQUEST_LATENCY_BUCKETS, registry=None)
        self.time_per_output_token = Histogram(
            "specdec_time_per_output_token_seconds",
            "per finished generation of 2+ tokens: (its last token's time - its first's) / (tokens - 1)",
            buckets=LATENCY_BUCKETS, registry=None)
        self.active_sessions = Gauge("specdec_active_sessions", "requests being served now",
                                     registry=None)
        self.cached_sessions = Gauge("specdec_cached_sessions", "sessions whose KV cache is held",
                                     registry=None)
        self.kv_cache_bytes = Gauge("specdec_kv_cache_bytes", "bytes held by KV caches",
                                    registry=None)
        self.queue_depth = Gauge("specdec_queue_depth", "calls waiting for a batch slot",
                                 registry=None)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # see _child
        for metric in list(vars(self).values()):
            if isinstance(metric, MetricWrapperBase) and service in FAMILIES[metric.describe()[0].name]:
                self.registry.register(metric)

    def record_round(self, proposer: Source | str, gamma: int, accepted: int,
                     stage_seconds: Mapping[str, float] | None = None, tree: bool = False) -> None:
        """One speculation round: γ proposed by `proposer`, `accepted` of them kept, and the
        seconds it spent per stage (draft, verify, store, coordinator). tree: the γ tokens were
        a token tree's nodes and `accepted` its accepted path's."""
        _check(proposer, ROUND_SOURCES, "proposer")
        if not 0 <= accepted <= gamma:
            raise ValueError(f"need 0 <= accepted <= gamma, got {accepted}, {gamma}")
        child = self._child
        if gamma > 0:
            child(self.num_drafts, proposer).inc()
            child(self.num_draft_tokens, proposer).inc(gamma)
            child(self.num_accepted_tokens, proposer).inc(accepted)
            for position in range(accepted):
                child(self.num_accepted_tokens_per_pos, proposer, str(position)).inc()
        if tree and gamma > 0:
            self.num_tree_drafts.inc()
            self.num_tree_draft_tokens.inc(gamma)
            for depth in range(1, accepted + 1):
                child(self.num_tree_accepted_tokens_per_depth, str(depth)).inc()
            self.tree_tokens_per_round.observe(accepted + 1)
        child(self.num_speculative_tokens, proposer).observe(gamma)
        child(self.tokens_per_round, proposer).observe(accepted + 1)
        for stage, seconds in (stage_seconds or {}).items():
            self.observe_stage(stage, seconds)

    def observe_stage(self, stage: str, seconds: float) -> None:
        """Time spent in one stage (a draft or target service times its own)."""
        _check(stage, STAGES, "stage")
        self._child(self.round_latency, stage).observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), looked up once: the coordinator records every round, every
        service every call, and prometheus_client's labels() validates and locks on each."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_first_token(self, seconds: float) -> None:
        """A generation's time to first token (the coordinator)."""
        self.time_to_first_token.observe(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        """A finished generation's mean time per token after its first (the coordinator)."""
        self.time_per_output_token.observe(seconds)

    def observe_batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def watch(self, **gauges: Callable[[], float]) -> None:
        """Gauges read when /metrics is scraped: `watch(queue_depth=lambda: worker.queue_depth)`
        (active_sessions, cached_sessions, kv_cache_bytes, queue_depth)."""
        for name, read in gauges.items():
            if name not in WATCHABLE:
                raise ValueError(f"gauge must be one of {', '.join(WATCHABLE)}, got {name!r}")
            getattr(self, name).set_function(read)

    def watch_kv_chunks(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Expose the K/V chunk counters and gauges (KV_CHUNK_COUNTERS, KV_CHUNK_GAUGES) that
        `read()` returns when /metrics is scraped; a name it leaves out is not exposed."""
        self.registry.register(_KVChunkCollector(read))

    def active(self) -> ContextManager:
        """`with metrics.active():` counts a request in specdec_active_sessions while it runs."""
        return self.active_sessions.track_inprogress()

    def record_request(self, method: str, code: Any) -> None:
        """A finished call: `code` is a grpc.StatusCode or its name ("OK", "INVALID_ARGUMENT")."""
        self._child(self.requests, method, str(getattr(code, "name", code))).inc()

    def record_http_request(self, path: str, status: int) -> None:
        """A finished HTTP call: `path` is its route's template ("/v1/completions"), `status` its code."""
        self._child(self.http_requests, path, str(status)).inc()

    def render(self) -> bytes:
        """The text exposition of this registry (what /metrics serves)."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics on host:port now (port 0 = an ephemeral port: see `.port`)."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve /metrics on {host}:{port} (--metrics-port): {exc}") from exc
        return MetricsServer(server, thread)


class _KVChunkCollector:
    """A collector of the values `read()` returns, at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, float]]):
        self.read = read

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self.read()
        with_store = "specdec_kv_store_up" in values  # the K/V tier has a KV store (--kv-store)
        values = {name: v for name, v in values.items() if with_store or not name.startswith(KV_STORE_PREFIX)}
        for name, help_text in KV_CHUNK_COUNTERS.items():
            if name in values:
                yield CounterMetricFamily(name, help_text, value=float(values[name]))
        for name, help_text in KV_CHUNK_GAUGES.items():
            if name in values:
                yield GaugeMetricFamily(name, help_text, value=float(values[name]))

    def describe(self):
        return []  # values appear only once read: nothing to check at registration


def serve_metrics(metrics: Metrics, port: int, host: str = "127.0.0.1") -> MetricsServer | None:
    """The service start-up hook: serve on `--metrics-port`, or nothing when it is 0 (off)."""
    if port < 0:
        raise ValueError(f"metrics port must be >= 0, got {port}")
    return metrics.serve(port, host) if port > 0 else None


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:
        return "unknown"
