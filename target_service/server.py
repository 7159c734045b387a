"""Start the target service."""

from __future__ import annotations

import dataclasses

import grpc

from specdec.config import TargetConfig
from specdec.rpc.server import build_sync_server
from specdec.runtime.runner import runner_from_config
from specdec.v1 import target_pb2, target_pb2_grpc

from target_service.servicer import TargetServicer
from target_service.verifier import Verifier

DEFAULT_PORT = 50053
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def start(config: TargetConfig) -> tuple[grpc.Server, int, TargetServicer]:
    """Load the model and serve it; returns (server, bound port, servicer)."""
    if not config.port:
        config = dataclasses.replace(config, port=DEFAULT_PORT)
    runner = runner_from_config(config)
    servicer = TargetServicer(Verifier(runner), runner.description)
    server, port = build_sync_server(
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s), [SERVICE_NAME],
        config.host, config.port, config.max_workers, config.max_message_bytes,
    )
    return server, port, servicer
