"""Build gRPC servers with health checking and reflection, sync or asyncio."""

from __future__ import annotations

from concurrent import futures
from typing import Callable, Iterable, Sequence

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


def _add_health_and_reflection(server, health_servicer, service_names: Iterable[str]) -> None:
    names = list(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )


def _bind(server, host: str, port: int) -> int:
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (address in use or not local?)")
    return bound


def build_sync_server(register: Callable[[grpc.Server], None], service_names: Iterable[str],
                      host: str, port: int, max_workers: int, max_message_bytes: int,
                      interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, int]:
    """A started thread-pool server; returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=channel_options(max_message_bytes), interceptors=list(interceptors))
    register(server)
    health_servicer = health.HealthServicer()
    names = list(service_names)
    _add_health_and_reflection(server, health_servicer, names)
    bound = _bind(server, host, port)
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def build_aio_server(register: Callable[[grpc.aio.Server], None], service_names: Iterable[str],
                           host: str, port: int, max_message_bytes: int
                           ) -> tuple[grpc.aio.Server, int]:
    """A started asyncio server; returns (server, bound port)."""
    server = grpc.aio.server(options=channel_options(max_message_bytes))
    register(server)
    health_servicer = health.aio.HealthServicer()
    names = list(service_names)
    _add_health_and_reflection(server, health_servicer, names)
    bound = _bind(server, host, port)
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def start_model_server(config, default_port: int, servicer, add_to_server, service_name: str,
                       interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, int]:
    """Serve a draft or target servicer as its ModelServiceConfig says (port 0: the default)."""
    return build_sync_server(lambda s: add_to_server(servicer, s), [service_name], config.host,
                             config.port or default_port, config.max_workers, config.max_message_bytes,
                             interceptors)
