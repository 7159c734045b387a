"""The deadline rule of calls to model services (coordinator/sessions/deadlines.py), on numbers."""

from __future__ import annotations

import pytest

from coordinator.sessions.deadlines import (ORDINARY_CALL_TOKENS, PACE_MIN_TOKENS, SAFETY, Pace,
                                            call_deadline_s, describe_work)


def test_a_call_of_ordinary_size_gets_the_ordinary_deadline():
    assert call_deadline_s(1, None, 60.0) == 60.0
    assert call_deadline_s(ORDINARY_CALL_TOKENS, None, 60.0) == 60.0
    assert call_deadline_s(4, 0.001, 60.0) == 60.0  # a fast replica never gets less


def test_a_longer_call_gets_the_ordinary_deadline_per_ordinary_size_or_its_measured_need():
    assert call_deadline_s(8 * ORDINARY_CALL_TOKENS, None, 60.0) == 8 * 60.0
    # 4,000 tokens at 0.5 s a token (a slow replica): SAFETY times that, past the floor
    assert call_deadline_s(4000, 0.5, 60.0) == pytest.approx(SAFETY * 4000 * 0.5)
    assert call_deadline_s(4000, 0.001, 60.0) == pytest.approx(60.0 * 4000 / ORDINARY_CALL_TOKENS)


def test_the_pace_follows_a_slower_call_at_once_and_a_faster_one_slowly():
    pace = Pace()
    pace.record(PACE_MIN_TOKENS - 1, 100.0)  # too few tokens to say anything about pace
    assert pace.seconds_per_token is None
    pace.record(1000, 10.0)
    assert pace.seconds_per_token == pytest.approx(0.01)
    pace.record(1000, 50.0)  # loaded: at once
    assert pace.seconds_per_token == pytest.approx(0.05)
    pace.record(1000, 10.0)  # faster again: slowly
    assert 0.01 < pace.seconds_per_token < 0.05


def test_a_call_that_ran_out_of_time_gives_the_retry_the_time_that_pace_needs():
    pace = Pace()
    pace.overran(466.0)  # not one ordinary call's tokens in 466 s
    assert pace.seconds_per_token == pytest.approx(466.0 / ORDINARY_CALL_TOKENS)
    assert call_deadline_s(3975, pace.seconds_per_token, 60.0) == pytest.approx(SAFETY * 3975 * 466.0 / 512)
    pace.overran(1.0)  # a short call's timeout never lowers it
    assert pace.seconds_per_token == pytest.approx(466.0 / ORDINARY_CALL_TOKENS)


def test_a_timeout_says_what_the_call_was_doing():
    assert describe_work("Verify", 3975) == "Verify: prefill of 3,975 tokens"
    assert describe_work("Verify", 3975, 3) == "Verify: prefill of 3,975 tokens and 3 drafts"
    assert describe_work("Verify", 1, 4) == "Verify: a round of 1 new token and 4 drafts"
    assert describe_work("Propose", 2) == "Propose: a round of 2 new tokens and 0 drafts"
