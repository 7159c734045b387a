"""The specdec command's start-up failures, run as a user would: one line saying what to fix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.process


def run_cli(*args, timeout=120, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_serve_coordinator_on_a_taken_port_says_so_in_one_line(flag):
    """No tiers run at the addresses given: only a check made before waiting for them answers,
    and it names the flag that moves the port, with no traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["serve", "coordinator", "--draft", "127.0.0.1:1", "--target", "127.0.0.1:2",
                "--port", "0", flag, str(port)]
        started = time.monotonic()
        result = run_cli(*argv)
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"specdec serve coordinator: port {port} is in use; choose another with {flag}")
    assert "Traceback" not in result.stderr and elapsed < 15, elapsed
