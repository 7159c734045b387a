"""bench/pace.py: the device-bound rate it compares with, the cases it runs, and one tiny run.

Here the process tests; the others are in tests/unit/test_bench_pace.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.unit.test_bench_pace import ROOT


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
