"""A short soak (≈ 30 s): concurrent new and continued sessions, no errors, no lost tokens, and
the draft's and target's KV caches held to a budget small enough that they must evict."""

from __future__ import annotations

import pytest

from bench.soak import analyse_memory, run_soak, slope_per_minute

BUDGET = 256 << 10  # bytes: a few dozen tiny-model sessions; the soak starts hundreds


@pytest.mark.process
def test_short_soak_has_no_errors_loses_nothing_and_keeps_the_kv_budget():
    result = run_soak(sessions=12, seconds=25, echo=lambda *_: None, kv_cache_bytes=BUDGET,
                      sample_seconds=1.0, warmup_seconds=8)
    assert result["error_count"] == 0, result["errors"]
    assert result["lost_tokens"] == 0
    # enough work to mean something, however loaded the machine (no throughput threshold here:
    # bench/soak.py measures that)
    assert result["requests"] >= 12
    assert result["distinct_sessions"] < result["requests"]  # some sessions were continued
    assert result["committed_tokens_checked"] > result["generated_tokens"] > 0

    assert result["kv_cache_bytes"] == BUDGET and result["sample_failures"] == 0
    assert result["kv_within_budget"], result["memory"]
    for service in ("draft", "target"):
        memory = result["memory"][service]
        assert memory["kv_samples"] >= 10  # sampled all along, from the service's own gauge
        assert memory["evictions"] > 0  # the budget was reached: the LRU had to evict
        assert BUDGET // 2 < memory["kv_max"] <= BUDGET + memory["kv_allowance"]
        assert 0 < memory["kv_idle"] <= BUDGET
        assert memory["cached_sessions_max"] < result["distinct_sessions"]
    for service in ("draft", "target", "coordinator"):
        memory = result["memory"][service]
        assert memory["rss_mb_end"] > 0 and memory["rss_mb_warm"] > 0


def _samples(kv_target: list[int], rss: list[float]) -> list[dict]:
    return [{"t": 10.0 * i, "target": {"rss_mb": r, "kv_bytes": kv, "cached_sessions": 3}}
            for i, (kv, r) in enumerate(zip(kv_target, rss))]


@pytest.mark.unit
def test_memory_analysis_flags_kv_past_the_budget_and_measures_rss_growth():
    samples = _samples([0, 900, 1000, 1050, 980], [100.0, 110.0, 112.0, 114.0, 116.0])
    idle = {"target": {"rss_mb": 118.0, "kv_bytes": 990, "cached_sessions": 3}}
    held = analyse_memory(samples, idle, budget=1000, warmup_s=10, allowances={"target": 100})["target"]
    assert held["kv_within_budget"] and held["kv_max"] == 1050 and held["kv_max_over_budget"] == 50
    assert held["kv_samples_over_budget"] == 1
    assert held["rss_mb_warm"] == 110.0 and held["rss_growth_mb"] == 8.0
    assert abs(held["rss_growth_mb_per_min"] - 12.0) < 1e-9  # 2 MB per 10 s sample

    over_under_load = analyse_memory(samples, idle, budget=1000, warmup_s=10, allowances={"target": 10})
    assert not over_under_load["target"]["kv_within_budget"]
    over_when_idle = analyse_memory(samples, {"target": {**idle["target"], "kv_bytes": 1001}}, budget=1000,
                                    warmup_s=10, allowances={"target": 100})
    assert not over_when_idle["target"]["kv_within_budget"]
    assert slope_per_minute([(0.0, 5.0)]) == 0.0
