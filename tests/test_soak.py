"""A short soak (≈ 30 s): concurrent new and continued sessions, no errors, no lost tokens."""

from __future__ import annotations

from bench.soak import run_soak


def test_short_soak_has_no_errors_and_loses_nothing():
    result = run_soak(sessions=12, seconds=25, echo=lambda *_: None)
    assert result["error_count"] == 0, result["errors"]
    assert result["lost_tokens"] == 0
    # enough work to mean something, however loaded the machine (no throughput threshold here:
    # bench/soak.py measures that)
    assert result["requests"] >= 12
    assert result["distinct_sessions"] < result["requests"]  # some sessions were continued
    assert result["committed_tokens_checked"] > result["generated_tokens"] > 0
