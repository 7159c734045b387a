"""Start the draft service."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import grpc

from specdec.config import DraftConfig
from specdec.rpc.model_server import serve_model
from specdec.rpc.security import server_credentials
from specdec.rpc.grpc_server import BackgroundServer
from specdec.runtime.engines import engine_from_config
from specdec.runtime.serving.scheduler import batch_scheduler
from specdec.runtime.serving.worker import ModelWorker
from specdec.tokenizer import fingerprints
from specdec.v1 import draft_pb2, draft_pb2_grpc

from draft_service.servicer import DraftServicer

DEFAULT_PORT = 50052
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def start(config: DraftConfig, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
          ) -> tuple[BackgroundServer, int, DraftServicer]:
    """Load the model and serve it (behind `interceptors`, if any); returns (server, bound port, servicer)."""
    credentials = server_credentials(config)  # before the model loads: a bad file fails at once
    engine = engine_from_config(config)
    drafting = engine.drafting(config.proposal_top_k)  # first: warm_up captures its loop's graphs
    engine.warm_up()  # before serving: the first call finds the engine ready
    worker = ModelWorker(config.max_queue, name="draft-model")
    scheduler = batch_scheduler(config, worker, drafting.propose_batch, lambda call: len(call.new_tokens) + len(call.hints))
    # a draft's ModelInfo.verifies_trees says whether it grows trees
    description = dataclasses.replace(engine.description, verifies_trees=engine.grows_trees)
    servicer = DraftServicer(engine, drafting, description, scheduler,
                             fingerprints(engine.tokenizer))
    server, port = serve_model(config, "draft", DEFAULT_PORT, servicer,
                               draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME, engine, worker,
                               credentials, interceptors, {"Propose": "draft"})
    return server, port, servicer
