"""Start the target service."""

from __future__ import annotations

import grpc

from specdec.config import TargetConfig
from specdec.rpc.server import start_model_server
from specdec.runtime.loader import tokenizer_fingerprint
from specdec.runtime.runner import runner_from_config
from specdec.v1 import target_pb2, target_pb2_grpc

from target_service.servicer import TargetServicer
from target_service.verifier import Verifier

DEFAULT_PORT = 50053
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def start(config: TargetConfig) -> tuple[grpc.Server, int, TargetServicer]:
    """Load the model and serve it; returns (server, bound port, servicer)."""
    runner = runner_from_config(config)
    servicer = TargetServicer(Verifier(runner), runner.description,
                              lambda n: tokenizer_fingerprint(runner.loaded.tokenizer, n))
    server, port = start_model_server(config, DEFAULT_PORT, servicer,
                                      target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME)
    return server, port, servicer
