"""Build asyncio gRPC servers with health checking and reflection."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


DEPENDENCY_CHECK_S = 5.0  # how often a dependency's health name is refreshed


async def _watch_dependency(health_servicer, name: str, probe: Callable[[], bool]) -> None:
    """Keep `name` SERVING while probe() (blocking: run on a thread) says the dependency answers,
    NOT_SERVING while it does not; the service's own names are not touched."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            up = await loop.run_in_executor(None, probe)
        except Exception:  # noqa: BLE001 - a probe that fails says the dependency is down
            up = False
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        await health_servicer.set(name, status)
        await asyncio.sleep(DEPENDENCY_CHECK_S)


def _add_health_and_reflection(server, health_servicer, service_names: Iterable[str]) -> None:
    names = list(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )


def _bind(server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen in plaintext, or with TLS when `credentials` are given."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises this when the bind fails
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use or not local?)")
    return bound


async def build_aio_server(register: Callable[[grpc.aio.Server], None], service_names: Iterable[str],
                           host: str, port: int, max_message_bytes: int,
                           credentials: grpc.ServerCredentials | None = None,
                           interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                           dependencies: Mapping[str, Callable[[], bool]] | None = None,
                           ) -> tuple[grpc.aio.Server, int]:
    """A started asyncio server; returns (server, bound port). `dependencies`: health names of
    what the service uses but can serve without (the KV store), each refreshed from its probe
    every few seconds; the service's own names stay SERVING whatever they say."""
    # no SO_REUSEPORT: a second server on a port in use must fail, not silently share it
    server = grpc.aio.server(options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)],
                             interceptors=list(interceptors))
    register(server)
    health_servicer = health.aio.HealthServicer()
    names = list(service_names)
    _add_health_and_reflection(server, health_servicer, names)
    bound = _bind(server, host, port, credentials)
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for name in dependencies or {}:  # known from the start; the first probe settles it
        await health_servicer.set(name, health_pb2.HealthCheckResponse.UNKNOWN)
    watchers = [asyncio.ensure_future(_watch_dependency(health_servicer, name, probe))
                for name, probe in (dependencies or {}).items()]
    if watchers:
        stop = server.stop

        async def stop_watching_too(grace):
            for watcher in watchers:
                watcher.cancel()
            return await stop(grace)

        server.stop = stop_watching_too
    return server, bound


class BackgroundServer:
    """An asyncio gRPC server running on its own event-loop thread (the draft and target
    services: their model work runs on a model worker thread, so this loop only moves
    messages and answers health checks). `stop(grace).wait()` stops it, like grpc.Server."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 on_stop: Callable[[], None] | None = None):
        self.server = server
        self.loop = loop
        self.thread = thread
        self.on_stop = on_stop
        self._stopping: concurrent.futures.Future | None = None

    def stop(self, grace: float | None) -> "BackgroundServer":
        if self._stopping is None:
            self._stopping = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop)
        return self

    def wait(self, timeout: float | None = None) -> None:
        if self._stopping is None:
            asyncio.run_coroutine_threadsafe(self.server.wait_for_termination(), self.loop).result(timeout)
            return
        self._stopping.result(timeout)
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if self.on_stop is not None:
                self.on_stop()


def start_model_server(config, default_port: int, servicer, add_to_server, service_name: str,
                       credentials: grpc.ServerCredentials | None = None,
                       on_stop: Callable[[], None] | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       dependencies: Mapping[str, Callable[[], bool]] | None = None) -> tuple[BackgroundServer, int]:
    """Serve a draft or target servicer as its ModelServiceConfig says (port 0: the default)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"{service_name}-grpc", daemon=True)
    thread.start()
    build = build_aio_server(lambda s: add_to_server(servicer, s), [service_name], config.host,
                             config.port or default_port, config.max_message_bytes, credentials,
                             interceptors, dependencies)
    try:
        server, port = asyncio.run_coroutine_threadsafe(build, loop).result(60)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if on_stop is not None:
            on_stop()
        raise
    return BackgroundServer(server, loop, thread, on_stop), port
