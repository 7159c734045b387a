"""Real gRPC servers on 127.0.0.1 ephemeral ports, in this process, for tests."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import grpc

from coordinator import server as coordinator_server
from draft_service import server as draft_server
from specdec.config import CoordinatorConfig, DraftConfig, TargetConfig
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from target_service import server as target_server

# concurrent requests of a statistical test (Cluster.complete_each): the services batch them, as
# in production, and the run takes a fraction of the time one request after another would
SAMPLING_WORKERS = 16


class LoopThread:
    """An asyncio loop in a daemon thread, for the coordinator's aio server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Cluster:
    """Draft + target (sync servers) and a coordinator (aio server), all on loopback.
    `client_credentials` makes the test's channel to the coordinator TLS; `metadata` goes with
    every call of complete() and stream()."""

    def __init__(self, draft_model: str, target_model: str, dtype: str = "float64",
                 coordinator: dict | None = None, draft: dict | None = None, target: dict | None = None,
                 client_credentials: grpc.ChannelCredentials | None = None,
                 metadata: tuple[tuple[str, str], ...] = (),
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        """interceptors: server interceptors both model services run behind (test spies)."""
        self.draft_config = DraftConfig(model=draft_model, dtype=dtype, port=0, **(draft or {}))
        self.target_config = TargetConfig(model=target_model, dtype=dtype, port=0, **(target or {}))
        self.coordinator_overrides = coordinator or {}
        self.client_credentials = client_credentials
        self.metadata = metadata
        self.interceptors = tuple(interceptors)
        self.loop = LoopThread()
        self.draft_port = self.target_port = 0
        self.draft = self.target = self.coordinator = None
        self.channel: grpc.Channel | None = None

    def _start_draft(self, port: int) -> None:
        config = dataclasses.replace(self.draft_config, port=port or _free_port())
        self.draft, self.draft_port, self.draft_servicer = draft_server.start(config, self.interceptors)

    def _start_target(self, port: int) -> None:
        config = dataclasses.replace(self.target_config, port=port or _free_port())
        self.target, self.target_port, self.target_servicer = target_server.start(config, self.interceptors)

    def start(self) -> "Cluster":
        self._start_draft(0)
        self._start_target(0)
        config = CoordinatorConfig(draft=f"127.0.0.1:{self.draft_port}",
                                   target=f"127.0.0.1:{self.target_port}", port=0,
                                   **self.coordinator_overrides)
        self.coordinator = self.loop.run(coordinator_server.start(config, startup_timeout_s=20))
        address = f"127.0.0.1:{self.coordinator.port}"
        self.channel = (grpc.secure_channel(address, self.client_credentials) if self.client_credentials
                        else grpc.insecure_channel(address))
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        return self

    def restart_target(self) -> None:
        """A fresh target process at the same address: every KV cache is gone."""
        self.target.stop(None).wait()
        self._start_target(self.target_port)

    def restart_draft(self) -> None:
        self.draft.stop(None).wait()
        self._start_draft(self.draft_port)

    def complete(self, **fields: Any) -> coordinator_pb2.CompleteResponse:
        request = coordinator_pb2.CompleteRequest(request=generate_request(**fields))
        return self.stub.Complete(request, timeout=120, metadata=self.metadata)

    def complete_each(self, seeds: Iterable[int], **fields: Any) -> list[coordinator_pb2.CompleteResponse]:
        """complete(seed=seed, **fields) for every seed, SAMPLING_WORKERS at a time; in seed order."""
        with ThreadPoolExecutor(SAMPLING_WORKERS) as pool:
            return list(pool.map(lambda seed: self.complete(seed=seed, **fields), seeds))

    def stream(self, **fields: Any) -> list[coordinator_pb2.GenerateResponse]:
        return list(self.stub.Generate(generate_request(**fields), timeout=120, metadata=self.metadata))

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.coordinator is not None:
            self.loop.run(self.coordinator.stop(None))
        for server in (self.draft, self.target):
            if server is not None:
                server.stop(None).wait()
        self.loop.close()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def generate_request(prompt: str | None = None, token_ids: list[int] | None = None,
                     messages: list[tuple[str, str]] | None = None, temperature: float | None = 0.0,
                     top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                     **fields: Any) -> coordinator_pb2.GenerateRequest:
    from specdec.v1 import common_pb2

    sampling = common_pb2.SamplingParams()
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    request = coordinator_pb2.GenerateRequest(sampling=sampling, **fields)
    if prompt is not None:
        request.prompt = prompt
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    if messages is not None:
        request.messages.messages.extend(coordinator_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    return request


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
