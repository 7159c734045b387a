"""The offline demo the README offers: `specdec models tiny DIR`, then `specdec up` on it with the
defaults, shows speculation at work (a draft that agrees with its target), run as a user would."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.redis_server import free_ports


def run_cli(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ), cwd=cwd)


def test_the_tiny_pair_shows_speculation_with_the_defaults(tmp_path):
    built = run_cli("models", "tiny", "tiny", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    port, draft_port, target_port = free_ports(3)
    # the README's form: relative directories, every other flag at its default
    result = run_cli("up", "--draft-model", "tiny/draft", "--target-model", "tiny/target",
                     "--port", str(port), "--draft-port", str(draft_port), "--target-port", str(target_port),
                     "--prompt", "def fibonacci(n):", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = re.search(r"\] rounds=(\d+) acceptance=([0-9.]+) tokens/round=([0-9.]+) generated=(\d+)",
                      result.stderr)
    assert stats, result.stderr[-3000:]
    rounds, acceptance, per_round, generated = (float(g) for g in stats.groups())
    assert acceptance > 0.5 and per_round > 1.2, stats.group(0)
    assert rounds < generated, stats.group(0)
    # the coordinator's ready line names what it serves where
    ready = next(line for line in result.stdout.splitlines() if line.startswith("coordinator ready"))
    assert "HTTP API off" in ready and "/metrics off" in ready and "session store memory" in ready, ready
