"""The chaos soak's CI version (bench/chaos.py): 42 s of load on replicated tiny float64
services, each on its own test host, with one process killed (and restarted) and then one link
cut for 8 s, both under the clients' load and followed by more of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_chaos_with_a_kill_and_a_cut_loses_nothing(tmp_path):
    # faults at 13 s and 26 s (the next, at 39 s, would be within 5 s of the end: none is)
    command = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--minutes", "0.7", "--every", "13",
               "--faults", "kill,cut", "--order", "cycle", "--sessions", "8", "--cut-s", "8",
               "--out", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    result = json.loads((tmp_path / "chaos.json").read_text())
    report = run.stdout[-4000:]
    assert result["faults_by_kind"] == {"kill": 1, "cut": 1}, report
    assert not result["fault_failures"], report
    assert result["requests"] > 20 and result["tokens_checked"] > 0, report
    assert result["lost_tokens"] == 0, report
    assert result["greedy_checked"] > 0 and result["greedy_mismatched"] == 0, report
    assert not result["undocumented_errors"], report
    assert result["hung_clients"] == 0 and result["overdue_requests"] == 0, report
    killed = [f["target"] for f in result["faults"] if f["kind"] == "kill"]
    assert result["rss"][killed[0]]["restarts"] == 1, report
    assert result["clean"] and run.returncode == 0, report
