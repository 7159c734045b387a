"""bench/gpu.py end to end on a CPU (--device cpu --quick: the tiny shape and specdec_cli.tiny's
tokenizer): every section of its JSON is there with sane numbers, also with the services on
the graph engine; how it shares out its deadline; a step failing in its own process; the
services' start-up lines read back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu, report
from bench.gpu_budget import Planner, Run, Status
from bench.gpu_isolated import run_isolated
from bench.gpu_services import service_figures
from bench.processes import free_port

ROOT = Path(__file__).resolve().parent.parent


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.unit
def test_each_step_gets_its_share_of_the_time_left():
    planner = Planner(deadline=100.0, weight_left=4.0)
    assert planner.limit(1.0, now=0.0) == pytest.approx(25.0)  # 1 of 4 weights left, 100 s left
    assert planner.limit(3.0, now=40.0) == pytest.approx(60.0)  # the last step gets all that is left
    assert planner.weight_left == 0.0
    assert Planner(deadline=10.0, weight_left=2.0).limit(1.0, now=20.0) == 0.0  # past the deadline


@pytest.mark.unit
def test_a_step_without_time_is_skipped_and_says_why(tmp_path):
    args = gpu.parse_args(["--device", "cpu", "--quick", "--deadline-s", "1", "--out", str(tmp_path / "g.json")])
    run = Run(args, {"steps": []})
    run.planner.weight_left = 1000.0  # many steps ahead: this one's share is far below its least
    ran = []
    assert run.step("a service step", "selfdraft", False, lambda clock: ran.append(clock)) is None
    assert not ran
    step = json.loads((tmp_path / "g.json").read_text())["steps"][0]
    assert step["status"] == Status.SKIPPED and "no time left" in step["reason"]


@pytest.mark.unit
def test_bad_flags_are_refused_with_the_choices(capsys):
    for argv, message in ((["--shapes", "70b"], "no shape 70b; choose from 7b, 1.5b"),
                          (["--backends", "vllm"], "no engine vllm; choose from torch, graph"),
                          (["--tokenizer", "/nonexistent"], "no tokenizer.json there")):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--device", "cpu", *argv])
        assert message in capsys.readouterr().err


@pytest.mark.process
def test_past_the_deadline_the_watchdog_writes_what_was_measured_and_exits(tmp_path):
    out = tmp_path / "gpu.json"
    script = f"""
import time
from bench import gpu, gpu_budget
gpu_budget.GRACE_S = 0.2
args = gpu.parse_args(["--device", "cpu", "--deadline-s", "0.3", "--out", {str(out)!r}])
run = gpu_budget.Run(args, {{"steps": [{{"name": "a step that hangs"}}], "shapes": {{"tiny": {{"build_s": 1.5}}}}}})
run.watchdog()
time.sleep(30)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["aborted"] == "stopped 0 s past the deadline, in step a step that hangs"
    assert doc["shapes"]["tiny"]["build_s"] == 1.5


@pytest.mark.process
def test_cpu_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    # an empty model cache: the tiny shape and tokenizer, also where `specdec models fetch` left
    # Qwen2.5's tokenizer (with it the run would take the far larger "small" shape)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--threads", "1",
                           "--port", str(free_port()), "--workdir", str(tmp_path), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [s["status"] for s in doc["steps"]] == ["ok"] * len(doc["steps"]), doc["steps"]
    assert len(doc["steps"]) == 1 + 7  # bandwidth; build, 2 engines, hf, self-draft, sessions, indep
    assert positive(doc["bandwidth"]["copy_GBps"])
    shape = doc["shapes"]["tiny"]
    models = shape["models"]
    assert models["target"]["layers"] == 6 and models["selfdraft"]["layers"] == 2
    assert models["target"]["weight_bytes"] > models["selfdraft"]["weight_bytes"] > 0
    roof = shape["roofline"]
    assert roof["weight_bytes"] == models["target"]["weight_bytes"]
    assert roof["tokens_per_s"] == pytest.approx(1e3 / roof["step_ms"])
    for name in ("torch", "graph"):
        engine = shape["engines"][name]
        assert sorted(map(int, engine["curve"]["ms"])) == doc["sizes"] == [1, 2, 3, 5, 9, 17, 33]
        assert all(positive(ms) for ms in engine["curve"]["ms"].values())
        assert engine["decode_ms"] == engine["curve"]["ms"]["1"]
        assert engine["of_roofline"]["1"] == pytest.approx(roof["step_ms"] / engine["decode_ms"])
    new = doc["max_new_tokens"]
    assert shape["hf_generate"]["tokens"] == new and positive(shape["hf_generate"]["decode_tps"])
    runs = shape["selfdraft"]["runs"]
    assert set(runs) == {report.TARGET_ONLY, "specdec draft γ=2", "specdec draft γ=4", "specdec draft γ=8",
                         report.AUTO, "hf plain"}
    for method, run in runs.items():
        assert run["tokens"] == new and positive(run["decode_tps"]), method
        assert run["identical"], f"{method} differs from target-only (greedy, float32)"
    assert shape["selfdraft"]["summary"]["alpha"] >= 0.8  # the self-draft agrees with its target
    assert runs["specdec draft γ=4"]["stats"]["tokens_per_round"] > 2
    indep = shape["indep"]["runs"]
    assert set(indep) == {report.TARGET_ONLY, report.AUTO} and indep[report.AUTO]["identical"]
    assert indep[report.AUTO]["stats"]["tokens_per_round"] < 1.5  # an unrelated draft: little accepted
    levels = {row["sessions"]: row for row in shape["concurrency"]}
    assert sorted(levels) == [1, 16, 64] and levels[1]["x_one_session"] == 1.0
    for sessions, row in levels.items():
        assert row["tokens"] == sessions * doc["concurrency_tokens"] and positive(row["tokens_per_second"])
    ratios = shape["ratios"]
    assert all(positive(v) for v in ratios.values()), ratios
    assert ratios["sessions64_x_one"] == pytest.approx(levels[64]["x_one_session"])
    assert {t["ratio"] for t in doc["targets"]} >= {"selfdraft_gamma4_x_target_only", "sessions64_x_one"}
    assert "issue 32's targets" in proc.stdout and f"wrote {out}" in proc.stdout


@pytest.mark.process
def test_a_step_that_fails_in_its_process_loses_that_step_only(tmp_path):
    """The step runs in a child (a CUDA fault there leaves this process's CUDA untouched): its
    error comes back as the step's, and the run goes on to the next step."""
    args = gpu.parse_args(["--device", "cpu", "--quick", "--deadline-s", "120", "--out", str(tmp_path / "g.json")])
    run = Run(args, {"steps": []})
    run.planner.weight_left = 2.0
    bad = {"device": "cuda:7", "nbytes": 1 << 20, "repeats": 1}  # no such device here: the child fails
    assert run.step("copy bandwidth", "bandwidth", False,
                    lambda clock: run_isolated("bandwidth", bad, clock, run.live)) is None
    good = run.step("copy bandwidth again", "bandwidth", False,
                    lambda clock: run_isolated("bandwidth", {**bad, "device": "cpu"}, clock, run.live))
    first, second = json.loads((tmp_path / "g.json").read_text())["steps"]
    assert first["status"] == Status.ERROR and first["reason"].startswith("StepFailed: ")
    assert second["status"] == Status.OK and positive(good["copy_GBps"]) and run.live == []


@pytest.mark.unit
def test_the_services_start_up_lines_are_read_per_service():
    log = "\n".join([
        "2026-01-01 00:00:01,000 INFO specdec.runtime.graph.engine: /m/target: graph engine on cuda:0, paged K/V "
        "pool of 4096 blocks x 16 tokens (57344 bytes per token, 3758096384 bytes; 2000000 bytes set aside for "
        "capture), 32 forward buckets, CUDA graphs on",
        "2026-01-01 00:00:09,000 INFO specdec.runtime.graph.engine: /m/target: 32 CUDA graphs captured in 7.5 s "
        "(1 failed, running eagerly); device memory 19000000000 bytes allocated, 21000000000 reserved",
        "2026-01-01 00:00:04,000 INFO specdec.runtime.graph.engine: /m/selfdraft: 64 CUDA graphs captured in 3.0 s "
        "(0 failed, running eagerly); device memory 5000 bytes allocated, 6000 reserved",
        "2026-01-01 00:00:10,000 INFO specdec_cli.serve: target service ready in 12.5 s (/m/target, bfloat16, "
        "graph cuda:0)",
        "2026-01-01 00:00:10,000 WARNING specdec.runtime.graph.capture: forward bucket ... failed to capture",
    ])
    figures = service_figures(log, {"target": "/m/target", "selfdraft": "/m/selfdraft"})
    target = figures["target"]
    assert target["pool"] == {"device": "cuda:0", "blocks": 4096, "pool_bytes": 3758096384, "reserve": 2000000,
                              "buckets": 32, "graphs": "on"}
    assert target["capture"] == {"captured": 32, "seconds": 7.5, "failed": 1, "allocated": 19000000000,
                                 "reserved": 21000000000}
    assert target["startup"] == {"kind": "target", "seconds": 12.5}
    assert figures["selfdraft"]["capture"]["captured"] == 64 and "pool" not in figures["selfdraft"]


@pytest.mark.process
def test_cpu_smoke_run_with_the_services_on_the_graph_engine(tmp_path):
    """The services on --backend graph (auto picks torch on a CPU, so the other smoke run never
    serves the graph engine): the self-draft's runs match target-only token for token, and each
    service's start-up lines (K/V pool, buckets, graphs off on a CPU, start-up time) are in the JSON."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
           "SPECDEC_TARGET_KV_CACHE_BYTES": str(16 << 20), "SPECDEC_DRAFT_KV_CACHE_BYTES": str(16 << 20)}
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--device", "cpu", "--quick", "--threads", "1",
                           "--service-backend", "graph", "--steps", "build,selfdraft", "--max-new-tokens", "8",
                           "--deadline-s", "400", "--port", str(free_port()), "--workdir", str(tmp_path),
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["service_backend"] == "graph"
    status = {s["name"]: s["status"] for s in doc["steps"]}
    assert status == {"copy bandwidth": "skipped", "tiny: build models": "ok", "tiny: engine torch": "skipped",
                      "tiny: engine graph": "skipped", "tiny: hf generate": "skipped", "tiny: specdec self-draft": "ok",
                      "tiny: concurrent sessions": "skipped",
                      "tiny: specdec independent draft": "skipped"}, doc["steps"]
    shape = doc["shapes"]["tiny"]
    runs = shape["selfdraft"]["runs"]
    assert set(runs) == {report.TARGET_ONLY, "specdec draft γ=2", "specdec draft γ=4", "specdec draft γ=8",
                         report.AUTO}
    for method, run in runs.items():
        assert run["tokens"] == doc["max_new_tokens"] and run["identical"], method
    assert runs["specdec draft γ=4"]["stats"]["tokens_per_round"] > 2  # the self-draft agrees with its target
    services = shape["services"]["selfdraft"]
    assert positive(services["startup_s"]) and services["error"] is None
    for role in ("target", "selfdraft"):
        started = services["services"][role]
        assert started["pool"]["graphs"] == "off" and started["pool"]["buckets"] > 0, started  # a CPU: eager
        assert started["pool"]["pool_bytes"] <= 16 << 20 and positive(started["startup"]["seconds"])
