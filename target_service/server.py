"""Start the target service."""

from __future__ import annotations

from typing import Sequence

import grpc

from specdec.config import TargetConfig
from specdec.rpc.server import start_model_server
from specdec.runtime.runner import runner_from_config
from specdec.v1 import target_pb2, target_pb2_grpc

from target_service.servicer import TargetServicer
from target_service.verifier import Verifier

DEFAULT_PORT = 50053
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def start(config: TargetConfig, interceptors: Sequence[grpc.ServerInterceptor] = ()
          ) -> tuple[grpc.Server, int, TargetServicer]:
    """Load the model and serve it (behind `interceptors`, if any); returns (server, bound port, servicer)."""
    runner = runner_from_config(config)
    servicer = TargetServicer(Verifier(runner), runner.description)
    server, port = start_model_server(config, DEFAULT_PORT, servicer,
                                      target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME,
                                      interceptors)
    return server, port, servicer
