"""Start the coordinator: connect to both services, check they agree, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Iterator

import grpc
import uvicorn

from specdec.config import CoordinatorConfig
from specdec.errors import SpecdecError
from specdec.metrics import Metrics, MetricsServer, serve_metrics
from specdec.rpc.metrics_interceptor import MetricsInterceptor
from specdec.rpc.security import (ApiKeyInterceptor, CredentialsError, read_api_key, server_credentials,
                                  upstream_credentials)
from specdec.rpc.grpc_server import build_aio_server
from specdec.tokenizer import ModelLoadError, load_tokenizer, tokenizer_fingerprint
from specdec.types import ModelDescription
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

from coordinator.recording import Recorder
from coordinator.sessions.clients import DraftClient, ServiceClient, TargetClient
from coordinator.sessions.discovery import DiscoveryError, from_config as discovery_from_config
from coordinator.round_loop import RoundLoop
from coordinator.api.openai_api import create_app
from coordinator.api.openai_protocol import served_model_names
from coordinator.sessions.routing import ReplicaPool, Routes
from coordinator.api.servicer import CoordinatorServicer
from coordinator.sessions.stores import open_store
from coordinator.sessions.model_tiers import Tier

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
    (the fingerprints are over ids < shared_vocab_size), and the models must share an eos id.
    Only the target's eos ids end generation, so the two sets may differ otherwise."""
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
    draft_eos, target_eos = set(draft.eos_token_ids), set(target.eos_token_ids)
    if not draft_eos & target_eos:
        raise StartupError(
            f"draft {draft.model_id!r} ends generation on eos ids {sorted(draft_eos)}, "
            f"target {target.model_id!r} on {sorted(target_eos)}: they share none; "
            "pick a draft model from the target's family")
    if draft_eos != target_eos:  # e.g. llama.cpp's end-of-generation set beside a checkpoint's eos
        log.info("draft %r ends generation on eos ids %s, target %r on %s: generation ends on the "
                 "target's (the draft's are not used)", draft.model_id, sorted(draft_eos),
                 target.model_id, sorted(target_eos))
    if tokenizer_fp != target.tokenizer_fingerprint:
        raise StartupError(
            f"the coordinator's tokenizer (fingerprint {tokenizer_fp[:12]}) differs from the target's "
            f"({target.tokenizer_fingerprint[:12]}): point --tokenizer at the target model")


@dataclass(frozen=True)
class Security:
    """What transport security the coordinator runs with, built (and checked) from its config."""

    server: grpc.ServerCredentials | None
    upstream: grpc.ChannelCredentials | None
    api_key: str | None

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> "Security":
        try:
            return cls(server_credentials(config), upstream_credentials(config),
                       read_api_key(config.api_key_file) if config.api_key_file else None)
        except CredentialsError as exc:
            raise StartupError(str(exc)) from exc

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ApiKeyInterceptor(self.api_key)] if self.api_key else []

    def describe(self) -> str:
        return (f"TLS {'on' if self.server else 'off'}, API key {'on' if self.api_key else 'off'}, "
                f"TLS to the tiers {'on' if self.upstream else 'off'}")


def _tls_failure(client: ServiceClient, detail: str) -> tuple[bool, str]:
    """(does waiting not help, what to check) when a connection failed while being set up."""
    text = detail.lower()
    kind = client.kind
    if "hostname verification" in text:
        name = (f"{client.server_name!r} (--upstream-server-name)" if client.server_name
                else f"the host of {client.address}")
        return True, (f"; TLS: the {kind} service's certificate is not for {name}: set "
                      "--upstream-server-name to a name in that certificate")
    if "handshake failed" in text:
        return True, (f"; the TLS handshake with the {kind} service failed: check that the CA in "
                      "--upstream-ca-file signed its certificate (--tls-cert-file) and that it serves TLS at all")
    if "socket closed" in text:
        if client.tls:
            return False, (f"; the {kind} service closed the connection during TLS set-up: when it requires "
                           "client certificates (mutual TLS, --tls-client-ca-file), give the coordinator "
                           "--upstream-cert-file / --upstream-key-file signed by that CA")
        return False, (f"; the {kind} service closed the connection during set-up: when it serves TLS "
                       "(--tls-cert-file), give the coordinator --upstream-ca-file (and --upstream-cert-file / "
                       "--upstream-key-file for mutual TLS)")
    return False, ""


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn in the coordinator's event loop: the coordinator, not uvicorn, handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpApiServer:
    """The OpenAI-compatible HTTP API (coordinator/api/openai_api.py), served by uvicorn beside the
    gRPC server, in the same event loop, with the gRPC port's TLS certificates."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, port: int):
        self.server = server
        self.task = task
        self.port = port  # the bound port (what -1 picked)

    @classmethod
    async def start(cls, round_loop: RoundLoop, config: CoordinatorConfig, api_key: str | None) -> "HttpApiServer":
        if not -1 <= config.http_port <= 65535:
            raise StartupError(f"--http-port must be a port number, 0 (off) or -1 (any free port), "
                               f"got {config.http_port}")
        if config.http_max_body_bytes < 1:
            raise StartupError(f"--http-max-body-bytes must be >= 1, got {config.http_max_body_bytes}")
        tls = bool(config.tls_cert_file and config.tls_key_file)  # as the gRPC port (Security checked it)
        mutual = tls and bool(config.tls_client_ca_file)
        settings = uvicorn.Config(
            create_app(round_loop, api_key, config.http_max_body_bytes,
                       served_model_names(config.served_model_name, round_loop.target_info.model_id)),
            lifespan="off", log_level="warning",
            access_log=False, ssl_certfile=config.tls_cert_file if tls else None,
            ssl_keyfile=config.tls_key_file if tls else None,
            ssl_ca_certs=config.tls_client_ca_file if mutual else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE)
        try:
            settings.load()  # the certificates are read here
            sock = socket.create_server((config.host, max(config.http_port, 0)),
                                        family=socket.getaddrinfo(config.host, None)[0][0])
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"cannot serve the HTTP API on {config.host}:{config.http_port} "
                               f"(--http-port): {exc}") from exc
        server = _EmbeddedUvicorn(settings)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            sock.close()
            raise StartupError(f"the HTTP API did not start on {config.host}:{config.http_port}: "
                               f"{task.exception()!r}")
        return cls(server, task, sock.getsockname()[1])

    async def stop(self, grace: float | None) -> None:
        """Stop taking requests; streams still running after `grace` seconds (None: at once) are cut."""
        self.server.config.timeout_graceful_shutdown = 0 if grace is None else max(grace, 0.0)
        self.server.should_exit = True
        await self.task


@dataclass
class RunningCoordinator:
    server: grpc.aio.Server
    port: int
    round_loop: RoundLoop
    metrics_server: MetricsServer | None = None
    http: HttpApiServer | None = None  # the OpenAI-compatible API (--http-port), None when off

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The model names the HTTP API answers to (--served-model-name, else the target's)."""
        return served_model_names(self.round_loop.config.served_model_name, self.round_loop.target_info.model_id)

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port (None: off)."""
        return self.http.port if self.http is not None else None

    async def stop(self, grace: float | None = 1.0) -> None:
        if self.http is not None:
            await self.http.stop(grace)
        await self.server.stop(grace)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self.round_loop.store.close()
        await self.round_loop.routes.close()
        if self.round_loop.recorder is not None:
            await asyncio.to_thread(self.round_loop.recorder.close)


def open_routes(config: CoordinatorConfig, upstream: grpc.ChannelCredentials | None) -> Routes:
    """The replica pools of both tiers, fed by the configured discovery (not started)."""
    try:
        discovery = discovery_from_config(config)
    except DiscoveryError as exc:
        raise StartupError(str(exc)) from exc
    options = (config.rpc_timeout_s, config.max_message_bytes, upstream, config.upstream_server_name,
               config.rpc_transport)
    return Routes(discovery,
                  ReplicaPool(Tier.DRAFT, lambda address: DraftClient(address, *options), config.draft_retry_s),
                  ReplicaPool(Tier.TARGET, lambda address: TargetClient(address, *options)))


def _unreachable(exc: SpecdecError, routes: Routes) -> StartupError:
    """Why the model services could not be reached, with each failing replica's last error and,
    for TLS set-up failures, what to check."""
    details = [f"{client.name}: {error}{_tls_failure(client, error)[1]}"
               for pool in (routes.drafts, routes.targets) for client, error in pool.failures()]
    return StartupError("; ".join([f"cannot reach the model services: {exc}", *details]))


async def _first_infos(routes: Routes, timeout_s: float) -> tuple[ModelDescription, ModelDescription]:
    """The model info of the first draft and the first target replica to answer."""
    try:
        return await asyncio.gather(routes.drafts.first_info(timeout_s), routes.targets.first_info(timeout_s))
    except SpecdecError as exc:
        raise _unreachable(exc, routes) from exc


async def start(config: CoordinatorConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> RunningCoordinator:
    """The first replicas to answer set the reference: the tokenizer fingerprints are compared over
    the ids both their models can emit; draft replicas must match the target, target replicas the
    first usable draft: a replica that differs is refused (logged), here and later."""
    security = Security.from_config(config)
    routes = open_routes(config, security.upstream)
    routes.start()
    deadline = time.monotonic() + startup_timeout_s
    try:
        draft_info, target_info = await _first_infos(routes, startup_timeout_s)
        shared = shared_vocab_size(draft_info, target_info)
        for pool in (routes.drafts, routes.targets):  # the fingerprints over the ids both can emit
            pool.fingerprint_below(shared)
        draft_info, target_info = await _first_infos(routes, max(deadline - time.monotonic(), 1.0))
        tokenizer_source = config.tokenizer or target_info.model_id
        try:
            tokenizer = load_tokenizer(tokenizer_source)
        except ModelLoadError as exc:
            raise StartupError(f"{exc}; set --tokenizer") from exc
        fingerprint = tokenizer_fingerprint(tokenizer, shared)
        try:
            draft_info = await routes.drafts.accept(
                lambda info: check_compatible(info, target_info, fingerprint), deadline - time.monotonic())
            await routes.targets.accept(
                lambda info: check_compatible(draft_info, info, fingerprint), deadline - time.monotonic())
        except StartupError:
            raise
        except SpecdecError as exc:
            raise _unreachable(exc, routes) from exc
        try:
            store = open_store(config.session_store, config.session_ttl_s, config.session_lease_s,
                               config.session_holder_ttl_s)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
    except StartupError:
        await routes.close()
        raise
    try:
        await store.ping()
    except SpecdecError as exc:  # serve anyway: requests answer UNAVAILABLE until it is back
        log.warning("%s", exc)
    metrics = Metrics("coordinator")
    recorder = None
    try:
        recorder = Recorder.from_config(config, draft_info.model_id, target_info.model_id)
        round_loop = RoundLoop(config, store, routes, tokenizer, draft_info, target_info, metrics, recorder)
        metrics_server = serve_metrics(metrics, config.metrics_port, config.host)
    except (ValueError, OSError) as exc:
        await asyncio.gather(store.close(), routes.close())
        if recorder is not None:
            recorder.close()
        raise StartupError(str(exc)) from exc
    servicer = CoordinatorServicer(round_loop)
    if security.api_key and not security.server:
        log.warning("--api-key-file without --tls-cert-file: clients send the API key in clear text")
    try:
        server, port = await build_aio_server(
            lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s), [SERVICE_NAME],
            config.host, config.port, config.max_message_bytes, security.server,
            [MetricsInterceptor(metrics), *security.interceptors()],
        )
    except BaseException:
        if metrics_server is not None:
            metrics_server.stop()
        raise
    http = None
    if config.http_port:
        try:
            http = await HttpApiServer.start(round_loop, config, security.api_key)
        except BaseException:
            await server.stop(None)
            if metrics_server is not None:
                metrics_server.stop()
            await asyncio.gather(store.close(), routes.close())
            raise
        log.info("OpenAI-compatible HTTP API on %s:%d", config.host, http.port)
    log.info("coordinator on %s:%d (%s; %s; %s%s)", config.host, port, routes.discovery.describe(),
             routes.describe(), security.describe(),
             "" if round_loop.draft_model.beside_verification else "; the tiers share CPU cores: the draft "
             "never works beside a verification")
    return RunningCoordinator(server, port, round_loop, metrics_server, http)
