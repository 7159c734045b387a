"""Start the coordinator: connect to both services, check they agree, serve."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from specdec.config import CoordinatorConfig
from specdec.errors import SpecdecError
from specdec.rpc.server import build_aio_server
from specdec.runtime.loader import ModelLoadError, load_tokenizer, tokenizer_fingerprint
from specdec.types import ModelDescription
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

from coordinator.clients import DraftClient, TargetClient
from coordinator.discovery import DiscoveryError, from_config as discovery_from_config
from coordinator.engine import Engine
from coordinator.routing import ReplicaPool, Routes
from coordinator.servicer import CoordinatorServicer
from coordinator.store import open_store

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
STARTUP_TIMEOUT_S = 120.0


class StartupError(RuntimeError):
    """The coordinator cannot start; the message says why."""


def check_compatible(draft: ModelDescription, target: ModelDescription, tokenizer_fp: str) -> None:
    """Draft, target and the coordinator's tokenizer must share one vocabulary."""
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise StartupError(
            "draft and target use different tokenizers: "
            f"draft {draft.model_id!r} has {draft.tokenizer_vocab_size} tokens "
            f"(fingerprint {draft.tokenizer_fingerprint[:12]}), target {target.model_id!r} has "
            f"{target.tokenizer_vocab_size} tokens (fingerprint {target.tokenizer_fingerprint[:12]}); "
            "pick a draft model from the target's family")
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        log.warning("draft eos ids %s differ from target eos ids %s; the target's are used",
                    draft.eos_token_ids, target.eos_token_ids)
    if tokenizer_fp != target.tokenizer_fingerprint:
        raise StartupError(
            f"the coordinator's tokenizer (fingerprint {tokenizer_fp[:12]}) differs from the target's "
            f"({target.tokenizer_fingerprint[:12]}): point --tokenizer at the target model")


@dataclass
class RunningCoordinator:
    server: grpc.aio.Server
    port: int
    engine: Engine

    async def stop(self, grace: float | None = 1.0) -> None:
        await self.server.stop(grace)
        await self.engine.store.close()
        await self.engine.routes.close()


def open_routes(config: CoordinatorConfig) -> Routes:
    """The replica pools of both tiers, fed by the configured discovery (not started)."""
    try:
        discovery = discovery_from_config(config)
    except DiscoveryError as exc:
        raise StartupError(str(exc)) from exc
    limits = (config.rpc_timeout_s, config.max_message_bytes)
    return Routes(discovery,
                  ReplicaPool("draft", lambda address: DraftClient(address, *limits), config.draft_retry_s),
                  ReplicaPool("target", lambda address: TargetClient(address, *limits)))


async def start(config: CoordinatorConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> RunningCoordinator:
    """The first target replica to answer sets the reference; draft replicas must match it, target
    replicas the first usable draft: a replica that differs is refused (logged), here and later."""
    routes = open_routes(config)
    routes.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        try:
            target_info = await routes.targets.first_info(startup_timeout_s)
        except SpecdecError as exc:
            raise StartupError(f"cannot reach the model services: {exc}") from exc
        tokenizer_source = config.tokenizer or target_info.model_id
        try:
            tokenizer = load_tokenizer(tokenizer_source)
        except ModelLoadError as exc:
            raise StartupError(f"{exc}; set --tokenizer") from exc
        fingerprint = tokenizer_fingerprint(tokenizer)
        try:
            draft_info = await routes.drafts.accept(
                lambda info: check_compatible(info, target_info, fingerprint), deadline - time.monotonic())
            await routes.targets.accept(
                lambda info: check_compatible(draft_info, info, fingerprint), deadline - time.monotonic())
        except SpecdecError as exc:
            raise StartupError(f"cannot reach the model services: {exc}") from exc
        try:
            store = open_store(config.session_store, config.session_ttl_s, config.session_lease_s)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
    except StartupError:
        await routes.close()
        raise
    try:
        await store.ping()
    except SpecdecError as exc:  # serve anyway: requests answer UNAVAILABLE until it is back
        log.warning("%s", exc)
    engine = Engine(config, store, routes, tokenizer, draft_info, target_info)
    servicer = CoordinatorServicer(engine)
    server, port = await build_aio_server(
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s), [SERVICE_NAME],
        config.host, config.port, config.max_message_bytes,
    )
    log.info("coordinator on %s:%d (%s; %s)", config.host, port, routes.discovery.describe(),
             routes.describe())
    return RunningCoordinator(server, port, engine)
