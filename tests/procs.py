"""Draft and target services as real processes (`specdec serve ...`), for fault tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from coordinator import server as coordinator_server
from specdec.config import CoordinatorConfig
from specdec.rpc.health import wait_healthy
from specdec.v1 import coordinator_pb2_grpc
from tests.cluster import LoopThread, generate_request
from tests.redis_server import free_port

P = TypeVar("P", bound="ServiceProcess")


def start_together(*procs: P) -> tuple[P, ...]:
    """Start the processes side by side (each imports torch and loads its model while the others
    do) and wait until every one answers; if one cannot start, all are stopped."""
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            for future in [pool.submit(proc.start) for proc in procs]:
                future.result()
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs


class ServiceProcess:
    """One `specdec serve draft|target` process on a fixed loopback port."""

    def __init__(self, kind: str, model: str, dtype: str = "float64", extra: list[str] | None = None):
        self.kind = kind
        self.model = model
        self.dtype = dtype
        self.extra = extra or []
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ServiceProcess":
        command = [sys.executable, "-m", "specdec_cli", "serve", self.kind, "--model", self.model,
                   "--dtype", self.dtype, "--port", str(self.port), *self.extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        wait_healthy(self.address, 120, [self.proc])
        return self

    def ensure_running(self) -> "ServiceProcess":
        """Running and answering: resumed if it was paused, started again if it died."""
        if self.proc is None or self.proc.poll() is not None:
            return self.start()
        self.resume()
        wait_healthy(self.address, 120, [self.proc])
        return self

    def kill(self) -> None:
        """SIGKILL: no goodbye, every KV cache gone."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class CoordinatorProcess(ServiceProcess):
    """A `specdec serve coordinator` process on a fixed loopback port (one that can be killed)."""

    def __init__(self, draft: str, target: str, extra: list[str] | None = None):
        super().__init__("coordinator", model="", extra=["--draft", draft, "--target", target, *(extra or [])])

    def start(self) -> "CoordinatorProcess":
        command = [sys.executable, "-m", "specdec_cli", "serve", "coordinator", "--port", str(self.port),
                   *self.extra]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.address, 120, [self.proc])
        return self

    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(self.address))


class Coordinator:
    """A coordinator served from this process (asyncio loop in a thread)."""

    def __init__(self, draft: str, target: str, **overrides: Any):
        self.loop = LoopThread()
        config = CoordinatorConfig(draft=draft, target=target, port=0, **overrides)
        self.running = self.loop.run(coordinator_server.start(config, startup_timeout_s=60))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.running.port}")
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    @property
    def round_loop(self):
        return self.running.round_loop

    def complete(self, **fields: Any):
        from specdec.v1 import coordinator_pb2

        return self.stub.Complete(coordinator_pb2.CompleteRequest(request=generate_request(**fields)),
                                  timeout=300)

    def stream(self, **fields: Any):
        return self.stub.Generate(generate_request(**fields), timeout=300)

    def replicas(self, tier: str) -> dict[str, str]:
        """address -> state (probing, ready, failed, refused) of the tier's replica pool."""
        async def states():
            pool = self.round_loop.routes.pools[tier]
            return {address: replica.state for address, replica in sorted(pool._replicas.items())}
        return self.loop.run(states())

    def describe_replicas(self, tier: str) -> str:
        async def describe():
            return self.round_loop.routes.pools[tier].describe()
        return self.loop.run(describe())

    def record(self, session_id: str):
        """The stored session record (tokens, and the replicas that hold it)."""
        return self.loop.run(self.round_loop.store.get(session_id))

    def stop(self) -> None:
        self.channel.close()
        self.loop.run(self.running.stop(None))
        self.loop.close()
