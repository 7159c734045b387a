"""Client side of grpc.health.v1: open a channel to a server, wait until it is SERVING.

The command line (`specdec up`), the benchmarks and the tests start services as processes
and wait here for each to come up.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.security import name_override_options


class NotHealthy(RuntimeError):
    """A server did not answer SERVING in time, or a process it waited on exited first;
    the message says which."""


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str = "") -> grpc.Channel:
    """A blocking channel: plaintext, or TLS with `credentials` (grpc.ChannelCredentials),
    checking `server_name` in the server's certificate instead of the address when given."""
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials, options=name_override_options(server_name))


def wait_healthy(address: str, timeout_s: float, procs: Sequence[subprocess.Popen] = (),
                 credentials: Any = None, server_name: str = "") -> None:
    """Wait until a gRPC server answers SERVING on grpc.health.v1; over TLS when `credentials`
    (grpc.ChannelCredentials) are given. Raises NotHealthy after `timeout_s`, or as soon as one
    of `procs` (the processes starting the services) has exited."""
    deadline = time.monotonic() + timeout_s
    with open_channel(address, credentials, server_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise NotHealthy(f"a service exited with code {proc.returncode} while starting")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise NotHealthy(f"{address} did not become healthy within {timeout_s:.0f}s")
