"""The load governor: short trials of speculation against plain decoding, the winner held."""

from __future__ import annotations

from coordinator.governor import PLAIN, SPECULATE, LoadGovernor
from coordinator.speculation import Speculation


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trial(governor: LoadGovernor, clock: Clock, load: int, speculating_rate: float, plain_rate: float) -> None:
    """Run one trial pair: each epoch commits tokens at the rate of the mode in force."""
    for _ in range(2):
        speculating = governor.speculate(load)
        for i in range(20):  # rounds spread over the epoch; the governor is asked before each
            clock.now += governor.epoch_s / 20
            rate = speculating_rate if speculating else plain_rate
            if i < 5:  # settling: the previous mode's rounds, not this mode's, commit now
                rate = plain_rate if speculating else speculating_rate
            governor.record(round(rate * governor.epoch_s / 20))
            if i < 19:
                assert governor.speculate(load) == speculating
        clock.now += 0.01  # past the epoch's end (no float rounding short of it)
    governor.speculate(load)  # the second epoch ends: the winner is chosen


def test_a_single_stream_is_left_to_its_policy():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    assert governor.speculate(1) and governor.phase == "idle"


def test_plain_decoding_wins_when_it_commits_more_tokens_and_holds():
    clock = Clock()
    governor = LoadGovernor(clock=clock, epoch_s=6.0, settle_s=2.0, hold_s=60.0)
    trial(governor, clock, 16, speculating_rate=19.0, plain_rate=33.0)
    assert (governor.phase, governor.mode) == ("hold", PLAIN)
    assert governor.rates[SPECULATE] < governor.rates[PLAIN]
    assert abs(governor.rates[PLAIN] - 33.0) < 2 and abs(governor.rates[SPECULATE] - 19.0) < 2  # settled
    clock.now += 59.0
    assert governor.speculate(1)  # a lone stream meanwhile: its own policy
    assert not governor.speculate(16)  # still held
    clock.now += 2.0
    assert governor.speculate(16) and governor.phase == "trial-speculate"  # tried again


def test_speculation_wins_when_it_commits_more_tokens():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    trial(governor, clock, 4, speculating_rate=40.0, plain_rate=15.0)
    assert (governor.phase, governor.mode) == ("hold", SPECULATE)
    assert governor.speculate(4)


def test_a_trial_stops_when_the_load_goes():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    governor.speculate(8)
    clock.now += 3.0
    governor.speculate(8)  # settled: counting
    clock.now += 3.5
    assert not governor.speculate(8)  # the plain epoch
    assert governor.speculate(1) and governor.phase == "idle"


def test_a_plain_verdict_only_overrides_adaptive_auto_requests():
    spec = Speculation(max_gamma=8, default_gamma=4, ngram_max=3, ngram_max_tokens=8)
    history = [5, 6, 7, 8, 1, 2, 5, 6, 7]
    assert spec.start("a", "auto", None).plan(history, 8, True, allowed=False).source == "none"
    assert spec.start("b", "auto", None).plan(history, 8, True, allowed=True).source != "none"
    assert spec.start("c", "auto", 3).plan(history, 8, True, allowed=False).gamma == 3  # fixed γ
    assert spec.start("d", "draft", None).plan(history, 8, True, allowed=False).source == "draft"
