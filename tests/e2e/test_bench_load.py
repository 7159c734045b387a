"""bench/load.py end to end against real services on a tiny pair: an open-loop load at two small
rates whose JSON adds up, and a full coordinator's refusals counted as 429s with Retry-After;
its schedule and its summaries as pure functions.

Here the e2e tests; the other tiers' are in tests/unit/test_bench_load.py.
"""

from __future__ import annotations

import importlib.util

import json

import pytest

from bench import load
from tests.cluster import Cluster

SHORT = "kv-cache-explain,lru-cache"  # prompts that fit the tiny models' 512-token context


def run_load(tmp_path, base_url: str, *options: str) -> dict:
    argv = ["--base-url", base_url, "--min-tokens", "3", "--max-tokens", "6", "--prompts", SHORT,
            "--warmup", "1", "--cooldown", "0", "--request-timeout", "60", "--out", str(tmp_path), *options]
    assert load.main(argv) == 0
    return json.loads((tmp_path / "load.json").read_text())


def served(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.coordinator.http_port}"


def test_a_load_at_two_rates_adds_up(models, tmp_path):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], coordinator={"http_port": -1}) as cluster:
        document = run_load(tmp_path, served(cluster), "--rates", "20,10", "--requests", "5", "--seed", "3")
    rows = document["rates"]
    assert [row["rate"] for row in rows] == [10.0, 20.0]  # ascending
    for row in rows:
        assert row["sent"] == 5 == len(row["requests"])
        assert row["sent"] == (row["completed"] + row["refused"] + row["errors"] + row["timeouts"]
                               + row["incomplete"])
        assert row["completed"] == 5 and row["errors"] == 0 and row["error_messages"] == []
        assert all(3 <= r["max_tokens"] == r["output_tokens"] <= 6 for r in row["requests"])
        assert row["output_tokens"] == sum(r["output_tokens"] for r in row["requests"])
        for key in ("ttft_ms", "tpot_ms", "latency_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p99"]
        assert row["ttft_ms"]["p99"] <= row["latency_ms"]["p99"]
        assert 0 < row["completed_per_s"] and row["output_tokens_per_s"] == pytest.approx(
            row["output_tokens"] / row["wall_s"])
        assert 1 <= row["max_in_flight"] <= 5 and len(row["load_average_before"]) == 3
        arrivals = [r["arrival_s"] for r in row["requests"]]
        assert arrivals == sorted(arrivals) and arrivals[0] < 0.5
    assert document["verdict"]["clean"] and document["verdict"]["unclean_rates"] == []
    assert document["model"] and (tmp_path / "load.txt").read_text().startswith("rate/s")
    # the plot needs matplotlib, of the bench extra (not installed by the README's test install)
    assert (tmp_path / "load.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    if (tmp_path / "load.png").exists():
        assert (tmp_path / "load.png").stat().st_size > 0


def test_a_full_coordinator_refuses_with_retry_after_and_loses_nothing(models, tmp_path):
    """One generation at a time: a burst is partly refused, each refusal a 429 with Retry-After,
    every admitted request complete."""
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 coordinator={"http_port": -1, "max_concurrent_generations": 1}) as cluster:
        document = run_load(tmp_path, served(cluster), "--rates", "200", "--requests", "8",
                            "--min-tokens", "24", "--max-tokens", "24", "--warmup", "0", "--no-plot")
    [row] = document["rates"]
    assert row["refused"] >= 1 and row["refused_with_retry_after"] == row["refused"]
    assert row["completed"] >= 1 and row["completed"] + row["refused"] == row["sent"] == 8
    assert all(r["status"] == 429 and r["retry_after"] == "1" for r in row["requests"] if r["outcome"] == "refused")
    assert document["verdict"]["clean"]
