"""Serve a draft or target servicer: its metrics endpoint, interceptors and shutdown, in one place."""

from __future__ import annotations

from typing import Sequence

import grpc

from specdec.metrics import Metrics, serve_metrics
from specdec.rpc.metrics_interceptor import MetricsInterceptor
from specdec.rpc.grpc_server import BackgroundServer, start_model_server
from specdec.runtime.engine import ModelEngine
from specdec.runtime.serving.worker import ModelWorker

# the health name of the KV store (--kv-store): SERVING while it answers. The service's own name
# stays SERVING either way: without the store, calls prefill instead of restoring.
KV_STORE_HEALTH = "specdec.v1.KVStore"


def serve_model(config, kind: str, default_port: int, servicer, add_to_server, service_name: str,
                engine: ModelEngine, worker: ModelWorker, credentials: grpc.ServerCredentials | None,
                interceptors: Sequence[grpc.aio.ServerInterceptor], timed: dict[str, str]
                ) -> tuple[BackgroundServer, int]:
    """Start the server with Prometheus metrics on --metrics-port (when set); `timed` maps the
    methods whose latency is recorded to their stage. Stopping the server stops the worker and
    the metrics endpoint."""
    metrics = Metrics(kind)
    servicer.scheduler.on_batch = metrics.observe_batch
    metrics.watch(queue_depth=lambda: worker.queue_depth, cached_sessions=lambda: len(engine.caches),
                  kv_cache_bytes=engine.caches.total_bytes)
    if engine.kv_tier is not None:
        metrics.watch_kv_chunks(engine.kv_tier.metrics)
    try:
        metrics_server = serve_metrics(metrics, config.metrics_port, config.host)
    except OSError:
        worker.close()
        raise

    def stop() -> None:
        worker.close()
        if metrics_server is not None:
            metrics_server.stop()

    tier = engine.kv_tier
    dependencies = {KV_STORE_HEALTH: tier.store.ping} if tier is not None and tier.store is not None else {}
    return start_model_server(config, default_port, servicer, add_to_server, service_name, credentials,
                              on_stop=stop, interceptors=[*interceptors, MetricsInterceptor(metrics, timed)],
                              dependencies=dependencies)
