"""bench/gpu.py end to end on a CPU (--device cpu --quick: the tiny shape and specdec_cli.tiny's
tokenizer): every section of its JSON is there with sane numbers; and how it shares out its
deadline.

Here the unit tests; the other tiers' are in tests/process/test_bench_gpu.py.
"""

from __future__ import annotations

import json

import pytest

from bench import gpu
from bench.gpu_budget import Planner, Run, Status
from bench.gpu_services import service_figures


def test_each_step_gets_its_share_of_the_time_left():
    planner = Planner(deadline=100.0, weight_left=4.0)
    assert planner.limit(1.0, now=0.0) == pytest.approx(25.0)  # 1 of 4 weights left, 100 s left
    assert planner.limit(3.0, now=40.0) == pytest.approx(60.0)  # the last step gets all that is left
    assert planner.weight_left == 0.0
    assert Planner(deadline=10.0, weight_left=2.0).limit(1.0, now=20.0) == 0.0  # past the deadline


def test_a_step_without_time_is_skipped_and_says_why(tmp_path):
    args = gpu.parse_args(["--device", "cpu", "--quick", "--deadline-s", "1", "--out", str(tmp_path / "g.json")])
    run = Run(args, {"steps": []})
    run.planner.weight_left = 1000.0  # many steps ahead: this one's share is far below its least
    ran = []
    assert run.step("a service step", "selfdraft", False, lambda clock: ran.append(clock)) is None
    assert not ran
    step = json.loads((tmp_path / "g.json").read_text())["steps"][0]
    assert step["status"] == Status.SKIPPED and "no time left" in step["reason"]


def test_bad_flags_are_refused_with_the_choices(capsys):
    for argv, message in ((["--shapes", "70b"], "no shape 70b; choose from 7b, 1.5b"),
                          (["--backends", "vllm"], "no engine vllm; choose from torch, graph"),
                          (["--tokenizer", "/nonexistent"], "no tokenizer.json there")):
        with pytest.raises(SystemExit):
            gpu.parse_args(["--device", "cpu", *argv])
        assert message in capsys.readouterr().err


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
