"""The specdec command, run as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

pytestmark = pytest.mark.process


def run_cli(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_json(llama_cluster):
    address = f"127.0.0.1:{llama_cluster.coordinator.port}"
    result = run_cli("generate", "--address", address, "--max-new-tokens", "12", "--gamma", "3",
                     "--ignore-eos", "--json", "def fibonacci(n):")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    assert set(out["stats"]) >= {"rounds", "acceptance_rate", "tokens_per_round", "draft_seconds"}
    expected = llama_cluster.complete(prompt="def fibonacci(n):", max_new_tokens=12, ignore_eos=True)
    assert out["token_ids"] == list(expected.token_ids) and out["text"] == expected.text
    # continue the session, via the env equivalent of --session
    more = run_cli("generate", "--address", address, "--max-new-tokens", "4", "--json", " more",
                   env={"SPECDEC_GENERATE_SESSION": out["session_id"]})
    assert json.loads(more.stdout)["session_id"] == out["session_id"]


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_generate_proposer(llama_cluster, proposer):
    address = f"127.0.0.1:{llama_cluster.coordinator.port}"
    prompt = "ab ab ab ab ab"
    result = run_cli("generate", "--address", address, "--max-new-tokens", "10", "--ignore-eos", "--json",
                     "--proposer", proposer, prompt)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)["stats"]
    expected = llama_cluster.complete(prompt=prompt, max_new_tokens=10, ignore_eos=True, num_speculative_tokens=0)
    assert json.loads(result.stdout)["token_ids"] == list(expected.token_ids)
    assert stats["draft_rounds"] == 0 or proposer == "draft"
    assert stats["ngram_rounds"] == 0 or proposer == "ngram"
    assert stats["draft_prefill_tokens"] == 0 or proposer == "draft"
    assert run_cli("generate", "--proposer", "eagle", "x").returncode == 2  # argparse refuses it


def test_generate_reports_bad_input(llama_cluster):
    address = f"127.0.0.1:{llama_cluster.coordinator.port}"
    result = run_cli("generate", "--address", address, "--top-p", "2", "hi")
    assert result.returncode == 2
    assert "INVALID_ARGUMENT" in result.stderr and "top_p" in result.stderr


def _free_port_block() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 60000:
            continue
        try:
            for port in (base, base + 1, base + 2):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    pytest.skip("no free block of three ports")


def test_up_runs_all_three_and_generates(models):
    port = _free_port_block()
    result = run_cli("up", "--draft-model", models["llama"]["draft"], "--target-model",
                     models["llama"]["target"], "--dtype", "float32", "--port", str(port), "--http-port", "0",
                     "--prompt", "def fibonacci(n):", "--max-new-tokens", "16", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "coordinator ready" in result.stdout
    assert "rounds=" in result.stderr and "acceptance=" in result.stderr


def test_up_without_fetched_pair_says_what_to_do(tmp_path):
    result = run_cli("up", env={"SPECDEC_CACHE_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert "specdec models fetch" in result.stderr


def test_up_stops_its_services_on_sigterm(models):
    import signal
    import time

    import psutil

    port = _free_port_block()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec_cli", "up", "--draft-model",
                             models["llama"]["draft"], "--target-model", models["llama"]["target"],
                             "--dtype", "float32", "--port", str(port), "--http-port", str(http_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if "Ctrl-C stops all" in line or time.monotonic() > deadline:
                break
        assert f"OpenAI-compatible API on http://127.0.0.1:{http_port}/v1" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read()) == {"status": "ok"}
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
