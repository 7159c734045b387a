"""Start the target service."""

from __future__ import annotations

from typing import Sequence

import grpc

from specdec.config import TargetConfig
from specdec.rpc.model_server import serve_model
from specdec.rpc.security import server_credentials
from specdec.rpc.grpc_server import BackgroundServer
from specdec.runtime.engines import engine_from_config
from specdec.runtime.serving.scheduler import batch_scheduler
from specdec.runtime.serving.worker import ModelWorker
from specdec.tokenizer import fingerprints
from specdec.v1 import target_pb2, target_pb2_grpc

from target_service.servicer import TargetServicer

DEFAULT_PORT = 50053
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def start(config: TargetConfig, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
          ) -> tuple[BackgroundServer, int, TargetServicer]:
    """Load the model and serve it (behind `interceptors`, if any); returns (server, bound port, servicer)."""
    credentials = server_credentials(config)  # before the model loads: a bad file fails at once
    engine = engine_from_config(config)
    engine.warm_up()  # before serving: the first call finds the engine ready
    worker = ModelWorker(config.max_queue, name="target-model")
    verification = engine.verification()
    scheduler = batch_scheduler(config, worker, verification.verify_batch,
                                lambda call: len(call.new_tokens) + len(call.drafts))
    servicer = TargetServicer(engine, verification, engine.description, scheduler,
                              fingerprints(engine.tokenizer))
    server, port = serve_model(config, "target", DEFAULT_PORT, servicer,
                               target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME, engine, worker,
                               credentials, interceptors, {"Verify": "verify"})
    return server, port, servicer
