"""bench/pace.py: the device-bound rate it compares with, the cases it runs, and one tiny run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import pace
from bench.pace_tables import TABLES

ROOT = Path(__file__).resolve().parent.parent


def _measured(tokens: int, rounds: int, draft_rounds: int = 0, draft_tokens: int = 0) -> dict:
    return {"tokens": tokens, "rounds": rounds, "draft_rounds": draft_rounds, "draft_tokens": draft_tokens}


@pytest.mark.unit
def test_the_device_bound_of_target_only_is_one_forward_a_token():
    pair = TABLES["h200-7b"]
    bound = pace.device_bound(pair, "target", 1, _measured(64, 64), 512)
    assert bound["tokens_per_round"] == 1.0 and bound["gamma"] == 0.0
    assert bound["rate"] == pytest.approx(1 / pair.target.seconds(1, 1, 512))
    four = pace.device_bound(pair, "target", 4, _measured(256, 256), 512)
    assert four["rate"] == pytest.approx(4 / pair.target.seconds(4, 1, 512))  # batched: nearly 4×


@pytest.mark.unit
def test_the_device_bound_of_a_drafted_round_pays_the_draft_loop_then_the_target():
    pair = TABLES["h200-7b"]
    # 10 rounds, each with a draft call of 4 tokens, 3.5 tokens a round
    bound = pace.device_bound(pair, "g4", 1, _measured(35, 10, 10, 40), 512)
    round_s = pair.draft.draft_loop_seconds(1, 4, 512) + pair.target.seconds(1, 5, 512)
    assert bound["device_round_ms"] == pytest.approx(1e3 * round_s)
    assert bound["rate"] == pytest.approx(3.5 / round_s)
    half = pace.device_bound(pair, "g4", 1, _measured(25, 10, 5, 20), 512)  # half the rounds drafted
    assert half["device_round_ms"] == pytest.approx(1e3 * (pair.draft.draft_loop_seconds(1, 4, 512) / 2
                                                           + pair.target.seconds(1, 3, 512)))


@pytest.mark.unit
def test_target_only_runs_on_the_first_coordinator_of_a_link_alone():
    args = argparse.Namespace(modes="target,g4,auto")
    assert pace.coordinator_cases(args, "on", True) == [("target", "-"), ("g4", "on"), ("auto", "on")]
    assert pace.coordinator_cases(args, "off", False) == [("g4", "off"), ("auto", "off")]
    assert pace.coordinator_cases(argparse.Namespace(modes="target"), "off", False) == []


@pytest.mark.process
def test_pace_runs_its_cases_on_the_timed_device_and_writes_json(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pace.py"), "--modes", "target,g4", "--sessions", "1,2",
         "--link-delay-ms", "0", "--ahead", "on", "--max-new-tokens", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((out / "pace.json").read_text())
    rows = {(r["mode"], r["sessions"]): r for r in doc["rows"]}
    assert set(rows) == {("target", 1), ("target", 2), ("g4", 1), ("g4", 2)}
    for row in rows.values():
        assert row["rate"] > 0 and row["bound_rate"] > 0 and row["cpu_coordinator_ms"] > 0
        assert row["tokens"] == 8 * row["sessions"]
    assert rows["g4", 1]["tokens_per_round"] > 1  # the near-copy draft is mostly accepted
    assert doc["timed"]["target"]["calls"] > 0 and doc["timed"]["draft"]["calls"] > 0
    assert "of bound" in run.stdout
