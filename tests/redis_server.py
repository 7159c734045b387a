"""A real redis-server on a free loopback port, owned by a test (stop it, restart it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: apt-get install redis-server (.ci/run does)")
    return path


class RedisServer:
    """redis-server with append-only persistence in `directory`, so a restart keeps the data."""

    def __init__(self, directory: Path, port: int | None = None, extra: list[str] | None = None,
                 tls: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra = extra or []
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        command = [redis_binary(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                   "--appendfsync", "always", "--dir", str(self.directory), *self.extra]
        if self.tls:
            command += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                        "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                        "--tls-auth-clients", "no"]
        else:
            command += ["--port", str(self.port)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.proc = None

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, **kwargs)
