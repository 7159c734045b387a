"""bench/load.py end to end against real services on a tiny pair: an open-loop load at two small
rates whose JSON adds up, and a full coordinator's refusals counted as 429s with Retry-After;
its schedule and its summaries as pure functions.

Here the unit tests; the other tiers' are in tests/e2e/test_bench_load.py.
"""

from __future__ import annotations

import pytest

from bench import load, load_report
from bench.load_report import Outcome, RequestResult
from bench.prompts import PROMPTS


def test_the_schedule_is_poisson_seeded_and_bounded():
    first = load.schedule(7, 2.0, 0, 300.0, PROMPTS, 5, 9)
    assert first == load.schedule(7, 2.0, 0, 300.0, PROMPTS, 5, 9)
    assert first != load.schedule(8, 2.0, 0, 300.0, PROMPTS, 5, 9)
    assert first[0].at_s == 0 and all(p.at_s < 300 for p in first)
    assert 500 < len(first) < 700  # about rate × duration
    gaps = [b.at_s - a.at_s for a, b in zip(first, first[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.15)
    assert {p.max_tokens for p in first} == set(range(5, 10)) and len({p.prompt.name for p in first}) == 10
    assert len(load.schedule(7, 2.0, 12, 1.0, PROMPTS, 5, 9)) == 12  # --requests wins over the duration


def test_rates_are_positive_and_sorted():
    assert load.parse_rates("2,0.1,0.5,2") == [0.1, 0.5, 2.0]
    for bad in ("0", "-1", "inf", "x", "1,,2"):
        with pytest.raises(ValueError):
            load.parse_rates(bad)


def _done(arrival: float, ttft: float, latency: float, tokens: int) -> RequestResult:
    return RequestResult(arrival, "p", tokens, Outcome.COMPLETED, ttft_s=ttft, latency_s=latency,
                         output_tokens=tokens)


def test_a_rate_summary_counts_outcomes_and_times_tokens_as_vllm_does():
    results = [_done(0.0, 0.1, 1.1, 11), _done(0.5, 0.2, 2.2, 11),
               RequestResult(0.6, "p", 5, Outcome.REFUSED, 429, "1"),
               RequestResult(0.7, "p", 5, Outcome.REFUSED, 429, None),
               RequestResult(0.8, "p", 5, Outcome.ERROR, 500, message="boom"),
               RequestResult(0.9, "p", 5, Outcome.ERROR, 500, message="boom")]
    row = load_report.summarise_rate(1.0, results, 4.0)
    assert (row["sent"], row["completed"], row["refused"], row["refused_with_retry_after"], row["errors"]) == (6, 2, 2, 1, 2)
    assert row["error_messages"] == ["500: boom"] and row["refused_share"] == pytest.approx(2 / 6)
    assert row["tpot_ms"]["p50"] == pytest.approx(150.0)  # (1.0 s / 10, 2.0 s / 10) -> 100, 200 ms
    assert row["output_tokens_per_s"] == pytest.approx(22 / 4) and row["completed_per_s"] == 0.5
    assert row["max_in_flight"] == 2  # [0, 1.1] and [0.5, 2.7] overlap
    assert row["mean_in_flight"] == pytest.approx((1.1 + 2.2) / 4.0)
    assert not load_report.is_clean(row)


def test_saturation_is_where_p99_tpot_doubles_and_the_verdict_bounds_what_follows():
    def row(rate, tpot_p99, ttft_p99=100.0, refused=0):
        return {"rate": rate, "tpot_ms": {"p50": tpot_p99 / 2, "p99": tpot_p99},
                "ttft_ms": {"p50": ttft_p99 / 2, "p99": ttft_p99}, "refused": refused,
                "refused_with_retry_after": refused, "errors": 0, "timeouts": 0, "incomplete": 0}

    rows = [row(0.1, 50), row(0.2, 70), row(0.5, 100), row(1, 150, 300, refused=4), row(2, 160, 400, refused=9)]
    assert load_report.saturation_rate(rows) == 0.5
    assert load_report.saturation_rate(rows[:2]) is None
    assert load_report.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and load_report.percentile([], 99) is None
    result = load_report.verdict(rows, 0.5)
    assert result["clean"] and result["rates_past_saturation"] == [1, 2] and result["refused_past_saturation"] == 13
    assert result["p99_tpot_past_saturation_over_saturation"] == pytest.approx(1.6)
    assert result["p99_ttft_past_saturation_over_saturation"] == pytest.approx(4.0)
