"""A short soak (≈ 30 s): concurrent new and continued sessions, no errors, no lost tokens, and
the draft's and target's KV caches held to a budget small enough that they must evict.

Here the process tests; the other tiers' are in tests/unit/test_soak.py.
"""

from __future__ import annotations

from bench.soak import run_soak

BUDGET = 256 << 10  # bytes: a few dozen tiny-model sessions; the soak starts hundreds


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
