"""A tensor-parallel rank that dies never hangs the target service (issue 45): SIGKILL rank 1 of
a `specdec serve target --tensor-parallel-size 2` process and the service exits non-zero within
30 s, its log naming the rank; no rank process outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec.rpc.health import wait_healthy
from tests.redis_server import free_port


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def rank_pids(pid: int) -> list[int]:
    """The service's rank processes (python -m specdec.runtime.graph.ranks ...)."""
    out = []
    for child in children(pid):
        try:
            if b"specdec.runtime.graph.ranks" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except FileNotFoundError:
            pass
    return out


def test_a_killed_rank_ends_the_service_naming_it(models, tmp_path):
    port = free_port()
    log = tmp_path / "target.log"
    command = [sys.executable, "-m", "specdec_cli", "serve", "target", "--model", models["llama"]["target"],
               "--backend", "graph", "--dtype", "float64", "--kv-cache-bytes", str(8 << 20), "--port", str(port),
               "--tensor-parallel-size", "2", "--prefix-cache-bytes", "0"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks: list[int] = []
    try:
        wait_healthy(f"127.0.0.1:{port}", 120, [proc])
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(30)
        assert code == 70, code
        assert time.monotonic() - started < 30
        assert "tensor-parallel rank 1 of 2 exited with status -9" in log.read_text()
    finally:
        for pid in [proc.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
