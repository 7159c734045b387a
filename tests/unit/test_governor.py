"""The load governor: short trials of speculation against plain decoding, the winner held.

Here the unit tests; the other tiers' are in tests/e2e/test_governor.py.
"""

from __future__ import annotations

from coordinator.policy.load_governor import PLAIN, SPECULATE, LoadGovernor, load_band
from coordinator.policy.speculation import Speculation
from tests.planning import plan_round


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


STEP = 0.1  # seconds per simulated round


def run(governor: LoadGovernor, clock: Clock, load: int, seconds: float, speculating_rate: float,
        plain_rate: float, settle: float = 1.0) -> dict[str, float]:
    """Simulate `seconds` of rounds at `load`: the governor is asked before each round, and the
    coordinator commits tokens at the rate of the mode in force — for `settle` seconds after a
    switch at the previous mode's rate (its rounds are still committing). Returns the seconds
    spent in each mode."""
    spent = {SPECULATE: 0.0, PLAIN: 0.0}
    mode, previous, switched = None, None, clock.now
    for _ in range(round(seconds / STEP)):
        now_mode = SPECULATE if governor.speculate(load) else PLAIN
        if now_mode != mode:
            previous, mode, switched = mode, now_mode, clock.now
        effective = previous if previous is not None and clock.now - switched < settle else mode
        rate = speculating_rate if effective == SPECULATE else plain_rate
        clock.now += STEP
        governor.record(round(rate * STEP))
        spent[mode] += STEP
    return spent


def test_load_bands():
    assert [load_band(n) for n in (2, 3, 4, 7, 8, 16, 31, 32)] == [1, 1, 2, 2, 3, 4, 4, 5]


def test_a_single_stream_is_left_to_its_policy():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    assert governor.speculate(1) and governor.phase == "idle"


def test_a_trial_starts_plain_when_nothing_is_known():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    assert not governor.speculate(16) and governor.phase == "trial-plain"


def test_plain_decoding_wins_and_the_losing_epoch_stops_early():
    clock = Clock()
    governor = LoadGovernor(clock=clock, epoch_s=6.0, settle_s=2.0, min_count_s=2.0, hold_s=60.0)
    spent = run(governor, clock, 16, 20.0, speculating_rate=190.0, plain_rate=330.0)
    assert (governor.phase, governor.mode) == ("hold", PLAIN)
    assert abs(governor.rates[PLAIN] - 330.0) < 10  # settled: the plain epoch's own rounds
    assert governor.rates[SPECULATE] < 0.9 * governor.rates[PLAIN]
    # 6 s plain, then speculation only until it trailed, counting from its start, for 2 s
    assert 1.9 <= spent[SPECULATE] <= 2.3
    assert governor.verdicts[load_band(16)][0] == PLAIN


def test_speculation_wins_when_it_commits_more_tokens():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    spent = run(governor, clock, 4, 20.0, speculating_rate=400.0, plain_rate=150.0)
    assert (governor.phase, governor.mode) == ("hold", SPECULATE)
    assert governor.speculate(4)
    assert spent[PLAIN] <= governor.epoch_s + STEP  # the plain epoch, then speculation held


def test_a_verdict_holds_then_is_tried_again_starting_with_the_winner():
    clock = Clock()
    governor = LoadGovernor(clock=clock, hold_s=60.0)
    run(governor, clock, 16, 14.0, speculating_rate=190.0, plain_rate=330.0)
    decided = governor.verdicts[load_band(16)][1]
    clock.now = decided + 59.0
    assert governor.speculate(1)  # a lone stream meanwhile: its own policy
    assert not governor.speculate(16) and governor.phase == "hold"  # still held
    clock.now = decided + 61.0
    assert not governor.speculate(16) and governor.phase == "trial-plain"  # tried again, plain first


def test_a_verdict_repeated_by_far_is_held_longer_a_close_one_not():
    clock = Clock()
    governor = LoadGovernor(clock=clock, hold_s=60.0, max_hold_s=200.0)
    holds = []
    for _ in range(4):  # speculation far behind each time: 60, 120, 200 (the cap), 200
        run(governor, clock, 16, 14.0, speculating_rate=60.0, plain_rate=330.0, settle=0.5)
        winner, decided, ratio, hold = governor.verdicts[load_band(16)]
        assert winner == PLAIN and ratio < 0.5
        holds.append(hold)
        clock.now = decided + hold - 1.0
        assert not governor.speculate(16) and governor.phase == "hold"  # still held
        clock.now = decided + hold + 1.0
    assert holds == [60.0, 120.0, 200.0, 200.0]
    run(governor, clock, 16, 14.0, speculating_rate=300.0, plain_rate=330.0, settle=0.5)  # close now
    assert governor.verdicts[load_band(16)][3] == 60.0


def test_plain_at_a_load_carries_to_higher_loads_and_speculation_to_lower():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    run(governor, clock, 16, 14.0, speculating_rate=190.0, plain_rate=330.0)
    assert governor.verdict(load_band(16)) == PLAIN
    assert not governor.speculate(40) and governor.phase == "hold"  # no trial of its own
    assert governor.verdict(load_band(4)) is None  # lower: not implied
    assert not governor.speculate(4) and governor.phase == "trial-plain"  # its own trial
    run(governor, clock, 4, 14.0, speculating_rate=400.0, plain_rate=150.0)
    assert governor.verdict(load_band(4)) == SPECULATE
    assert governor.verdict(load_band(2)) == SPECULATE  # implied below
    assert governor.speculate(2) and governor.phase == "hold"
    # 8-15: speculation won decisively at 4-7 (400 vs 150), plain narrowly at 16-31: speculate
    assert governor.verdict(load_band(8)) == SPECULATE


def test_a_close_second_epoch_runs_its_length():
    clock = Clock()
    governor = LoadGovernor(clock=clock, epoch_s=6.0, settle_s=2.0)
    spent = run(governor, clock, 16, 20.0, speculating_rate=320.0, plain_rate=330.0)
    assert governor.mode == PLAIN and 5.9 <= spent[SPECULATE] <= 6.3
    assert abs(governor.rates[SPECULATE] - 320.0) < 10  # settled


def test_a_trial_starts_again_when_the_load_moves_to_another_band():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    assert not governor.speculate(2) and governor.phase == "trial-plain"
    clock.now += 5.0
    governor.speculate(2)
    started = clock.now
    clock.now += 0.5
    assert not governor.speculate(16) and governor.phase == "trial-plain"
    run(governor, clock, 16, 14.0, speculating_rate=190.0, plain_rate=330.0)
    assert set(governor.verdicts) == {load_band(16)} and governor.verdicts[load_band(16)][1] > started + 6


def test_a_decisive_verdict_reaches_one_band_the_other_way():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    run(governor, clock, 16, 14.0, speculating_rate=60.0, plain_rate=330.0, settle=0.5)  # far behind
    assert governor.verdicts[load_band(16)][2] < 0.5
    assert governor.verdict(load_band(8)) == PLAIN and governor.verdict(load_band(4)) is None
    assert not governor.speculate(8) and governor.phase == "hold"


def test_a_trial_moving_to_a_band_with_a_verdict_follows_it():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    run(governor, clock, 16, 14.0, speculating_rate=190.0, plain_rate=330.0)
    clock.now += 1.0
    assert not governor.speculate(4) and governor.phase == "trial-plain"  # no verdict at 4-7
    assert not governor.speculate(32) and governor.phase == "hold"  # plain at 16 holds at 32


def test_a_trial_stops_when_the_load_goes():
    clock = Clock()
    governor = LoadGovernor(clock=clock)
    assert not governor.speculate(8)
    clock.now += 3.0
    governor.speculate(8)  # settled: counting
    assert governor.speculate(1) and governor.phase == "idle"
    assert governor.verdicts == {}


def test_a_plain_verdict_only_overrides_adaptive_auto_requests():
    spec = Speculation(max_gamma=8, default_gamma=4)
    history = [5, 6, 7, 8, 1, 2, 5, 6, 7]
    assert plan_round(spec.start("a", "auto", None), history, 8, True, allowed=False).source == "none"
    assert plan_round(spec.start("b", "auto", None), history, 8, True, allowed=True).source != "none"
    assert plan_round(spec.start("c", "auto", 3), history, 8, True, allowed=False).gamma == 3  # fixed γ
    assert plan_round(spec.start("d", "draft", None), history, 8, True, allowed=False).source == "draft"
