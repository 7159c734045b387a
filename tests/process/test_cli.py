"""The specdec command, run as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest


def run_cli(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_json(llama_cluster):
    address = f"127.0.0.1:{llama_cluster.coordinator.port}"
    result = run_cli("generate", "--address", address, "--max-new-tokens", "12", "--gamma", "3",
                     "--ignore-eos", "--json", "--temperature", "0", "def fibonacci(n):")
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
                     "--temperature", "0", "--proposer", proposer, prompt)
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
    assert "INVALID_ARGUMENT" in result.stderr and "--top-p must be in" in result.stderr
    # the command names its own flags, not the gRPC API's fields
    result = run_cli("generate", "--address", address, "--session", "no-such-session", "hi")
    assert result.returncode == 2 and "omit --session" in result.stderr and "session_id" not in result.stderr
    result = run_cli("generate", "--address", address, "--max-new-tokens", "0", "hi")
    assert result.returncode == 2 and "--max-new-tokens must be in [1, " in result.stderr, result.stderr


def test_generate_without_a_coordinator_says_how_to_start_one():
    """A server-side failure exits 1 (2 is for usage), in one line that says what to do."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = run_cli("generate", "--address", f"127.0.0.1:{port}", "--timeout", "20", "hi")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"specdec generate: no coordinator at 127.0.0.1:{port}: start one with `specdec up` "
        "(or point --address at one)"], result.stderr


def test_generate_samples_at_the_apis_default_temperature():
    """`specdec generate` with no --temperature asks what the gRPC and HTTP APIs default to."""
    from specdec_cli.generate import build_request
    from specdec_cli.main import build_parser

    request = build_request(build_parser().parse_args(["generate", "hi"]))
    assert request.sampling.temperature == 1.0
    assert build_request(build_parser().parse_args(["generate", "--temperature", "0", "hi"])).sampling.temperature == 0


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


def test_up_runs_all_three_and_generates(models, tmp_path):
    port = _free_port_block()
    key_file = tmp_path / "key"
    key_file.write_text("up-key\n")
    with socket.socket() as busy:  # a one-shot --prompt run serves no HTTP: a taken --http-port is no matter
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = run_cli("up", "--draft-model", models["llama"]["draft"], "--target-model",
                         models["llama"]["target"], "--dtype", "float32", "--port", str(port),
                         "--http-port", str(busy.getsockname()[1]), "--api-key-file", str(key_file),
                         "--prompt", "def fibonacci(n):", "--max-new-tokens", "16", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "coordinator ready" in result.stdout
    assert "rounds=" in result.stderr and "acceptance=" in result.stderr


@pytest.mark.parametrize("taken, flag", [(1, "--draft-port"), (2, "--target-port"), (0, "--port"),
                                         (3, "--http-port"), (5, "--metrics-port")])
def test_up_refuses_a_taken_port_before_loading_any_model(taken, flag):
    """Every port is checked first: the models named here do not even exist, so only a check made
    before loading them can answer, and it names the flag that moves the port."""
    import time

    port = _free_port_block()
    argv = ["up", "--draft-model", "/no/such/draft", "--target-model", "/no/such/target", "--port", str(port)]
    if flag == "--http-port":
        argv += ["--http-port", str(port + 3)]
    if flag == "--metrics-port":
        argv += ["--http-port", "0", "--metrics-port", str(port + 3)]  # its draft's is port + 4, target's + 5
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + taken))
        busy.listen()
        started = time.monotonic()
        result = run_cli(*argv, timeout=60)
        elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert f"port {port + taken} is in use; choose another with {flag}" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # that line only: no gRPC log lines
    assert elapsed < 30, elapsed


def test_up_without_fetched_pair_says_what_to_do(tmp_path):
    result = run_cli("up", env={"SPECDEC_CACHE_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert "specdec models fetch" in result.stderr


def test_up_stops_its_services_on_sigterm(models):
    import signal
    import time

    import psutil

    port = _free_port_block()
    metrics_port = _free_port_block()
    while abs(metrics_port - port) < 3:
        metrics_port = _free_port_block()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec_cli", "up", "--draft-model",
                             models["llama"]["draft"], "--target-model", models["llama"]["target"],
                             "--dtype", "float32", "--port", str(port), "--http-port", str(http_port),
                             "--metrics-port", str(metrics_port), "--served-model-name", "tiny", "tiny-2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if "Ctrl-C stops all" in line or time.monotonic() > deadline:
                break
        assert f"OpenAI-compatible API on http://127.0.0.1:{http_port}/v1 (model 'tiny' or 'tiny-2')" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read()) == {"status": "ok"}
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as reply:
            assert [entry["id"] for entry in json.loads(reply.read())["data"]] == ["tiny", "tiny-2"]
        for offset, service in enumerate(("coordinator", "draft", "target")):  # --metrics-port and the next two
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + offset}/metrics", timeout=10) as reply:
                assert f'service="{service}"' in reply.read().decode()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()


def test_up_passes_the_service_flags_on():
    """--session-store, --api-key-file, --served-model-name reach the coordinator as its own flags,
    --metrics-port each service (the next two for the draft and the target)."""
    from specdec_cli import up
    from specdec_cli.main import build_parser

    args = build_parser().parse_args(["up", "--port", "6000", "--metrics-port", "9100", "--session-store",
                                      "redis://127.0.0.1:6379/0", "--api-key-file", "/k", "--served-model-name",
                                      "a", "b"])
    argvs = up.commands(args, "D", "T", {"draft": "127.0.0.1:6001", "target": "127.0.0.1:6002"})
    coordinator = argvs["coordinator"]
    assert coordinator[coordinator.index("--session-store") + 1] == "redis://127.0.0.1:6379/0"
    assert coordinator[coordinator.index("--api-key-file") + 1] == "/k"
    assert coordinator[coordinator.index("--served-model-name") + 1:][:2] == ["a", "b"]
    for service, port in (("coordinator", "9100"), ("draft", "9101"), ("target", "9102")):
        assert argvs[service][argvs[service].index("--metrics-port") + 1] == port


def test_up_passes_recording_on_only_when_asked():
    from specdec.config import CoordinatorConfig, from_sources
    from specdec_cli import up
    from specdec_cli.main import build_parser

    addresses = {"draft": "127.0.0.1:6001", "target": "127.0.0.1:6002"}
    plain = up.commands(build_parser().parse_args(["up"]), "D", "T", addresses)["coordinator"]
    assert not [flag for flag in plain if flag.startswith("--record")]
    asked = up.commands(build_parser().parse_args(["up", "--record-dir", "/r", "--record-max-bytes", "1000"]),
                        "D", "T", addresses)["coordinator"]
    parsed = build_parser().parse_args(asked[asked.index("serve"):])  # as the child parses it
    assert parsed.service == "coordinator"
    config = from_sources(CoordinatorConfig, "coordinator", vars(parsed), env={})
    assert (config.record_dir, config.record_max_bytes, config.record_stream) == ("/r", 1000, "")
