"""A short soak (≈ 30 s): concurrent new and continued sessions, no errors, no lost tokens, and
the draft's and target's KV caches held to a budget small enough that they must evict.

Here the unit tests; the other tiers' are in tests/process/test_soak.py.
"""

from __future__ import annotations

from bench.soak import analyse_memory, slope_per_minute


def _samples(kv_target: list[int], rss: list[float]) -> list[dict]:
    return [{"t": 10.0 * i, "target": {"rss_mb": r, "kv_bytes": kv, "cached_sessions": 3}}
            for i, (kv, r) in enumerate(zip(kv_target, rss))]


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
