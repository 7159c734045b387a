"""Start the coordinator: connect to both services, check they agree, serve."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from specdec.config import CoordinatorConfig
from specdec.errors import SpecdecError
from specdec.rpc.server import build_aio_server
from specdec.runtime.loader import ModelLoadError, load_tokenizer, tokenizer_fingerprint
from specdec.types import ModelDescription
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

from coordinator.clients import DraftClient, TargetClient
from coordinator.engine import Engine
from coordinator.servicer import CoordinatorServicer
from coordinator.store import open_store

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
STARTUP_TIMEOUT_S = 120.0


class StartupError(RuntimeError):
    """The coordinator cannot start; the message says why."""


def shared_vocab_size(draft: ModelDescription, target: ModelDescription) -> int:
    """The ids both models can emit: below the smaller of their output sizes."""
    return min(draft.vocab_size, target.vocab_size)


def check_compatible(draft: ModelDescription, target: ModelDescription, tokenizer_fp: str) -> None:
    """Draft, target and the coordinator's tokenizer must agree on every id both models can emit
    (the fingerprints are over ids < shared_vocab_size), and the models on their eos ids."""
    shared = shared_vocab_size(draft, target)
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise StartupError(
            "draft and target use different tokenizers: "
            f"draft {draft.model_id!r} has {draft.tokenizer_vocab_size} tokens "
            f"(output size {draft.vocab_size}, fingerprint {draft.tokenizer_fingerprint[:12]}), "
            f"target {target.model_id!r} has {target.tokenizer_vocab_size} tokens "
            f"(output size {target.vocab_size}, fingerprint {target.tokenizer_fingerprint[:12]}); "
            f"some id below {shared} means different tokens to them: "
            "pick a draft model from the target's family")
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise StartupError(
            f"draft {draft.model_id!r} ends generation on eos ids {sorted(draft.eos_token_ids)}, "
            f"target {target.model_id!r} on {sorted(target.eos_token_ids)}: they must agree; "
            "pick a draft model from the target's family")
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
        await self.engine.draft.close()
        await self.engine.target.close()


async def start(config: CoordinatorConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> RunningCoordinator:
    draft = DraftClient(config.draft, config.rpc_timeout_s, config.max_message_bytes)
    target = TargetClient(config.target, config.rpc_timeout_s, config.max_message_bytes)
    try:
        try:
            draft_info = await draft.info(startup_timeout_s)
            target_info = await target.info(startup_timeout_s)
            shared = shared_vocab_size(draft_info, target_info)
            # the fingerprints over the ids both models can emit
            draft_info = await draft.info(startup_timeout_s, fingerprint_vocab_size=shared)
            target_info = await target.info(startup_timeout_s, fingerprint_vocab_size=shared)
        except SpecdecError as exc:
            raise StartupError(f"cannot reach the model services: {exc}") from exc
        tokenizer_source = config.tokenizer or target_info.model_id
        try:
            tokenizer = load_tokenizer(tokenizer_source)
        except ModelLoadError as exc:
            raise StartupError(f"{exc}; set --tokenizer") from exc
        check_compatible(draft_info, target_info, tokenizer_fingerprint(tokenizer, shared))
        try:
            store = open_store(config.session_store, config.session_ttl_s, config.session_lease_s)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
    except StartupError:
        await draft.close()
        await target.close()
        raise
    try:
        await store.ping()
    except SpecdecError as exc:  # serve anyway: requests answer UNAVAILABLE until it is back
        log.warning("%s", exc)
    engine = Engine(config, store, draft, target, tokenizer, draft_info, target_info)
    servicer = CoordinatorServicer(engine)
    server, port = await build_aio_server(
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s), [SERVICE_NAME],
        config.host, config.port, config.max_message_bytes,
    )
    log.info("coordinator on %s:%d (draft %s, target %s)", config.host, port, config.draft, config.target)
    return RunningCoordinator(server, port, engine)
