"""--draft-ahead auto: alternating epochs with and without calls made ahead, the faster kept."""

from __future__ import annotations

import random

import pytest

from coordinator.policy.draft_ahead_trial import OFF, ON, PATTERN, DraftAheadTrial


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(governor: DraftAheadTrial, clock: Clock, rounds: int, on_rate: float, off_rate: float,
        load: int = 1, sessions: int = 1, noise: float = 0.2, seed: int = 0,
        last: dict[str, str] | None = None) -> dict[str, int]:
    """Simulate `rounds` draft rounds (round-robin over `sessions`): each commits 1–6 tokens at
    `on_rate` tokens/s when it and its session's round before ran with calls made ahead (the
    drafts were made ahead), else at `off_rate`, times a noise factor. Returns rounds per mode."""
    rng = random.Random(seed)
    last = {} if last is None else last  # session -> the mode of its last round
    spent = {ON: 0, OFF: 0}
    for i in range(rounds):
        session = f"s{i % sessions}"
        mode = governor.mode(load)
        rate = on_rate if mode == ON and last.get(session) == ON else off_rate
        tokens = rng.randint(1, 6)
        seconds = tokens / rate * rng.uniform(1 - noise, 1 + noise)
        clock.now += seconds / sessions
        governor.record(session, load, mode, tokens, seconds)
        last[session] = mode
        spent[mode] += 1
    return spent


def until_verdict(governor: DraftAheadTrial, clock: Clock, on_rate: float, off_rate: float, seed: int = 0) -> None:
    last: dict[str, str] = {}
    for chunk in range(1000):
        run(governor, clock, 1, on_rate, off_rate, seed=seed * 1000 + chunk, last=last)
        if governor.bands[0].verdict is not None:
            return
    raise AssertionError("no verdict")


def test_fixed_settings_never_measure():
    for setting in (ON, OFF):
        governor = DraftAheadTrial(setting)
        governor.record("s", 1, setting, 3, 0.5)
        assert governor.mode(1) == setting and governor.mode(40) == setting
        assert not governor.bands


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="auto, on, off"):
        DraftAheadTrial("sometimes")


def test_epochs_run_off_on_on_off():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock, epoch_rounds=3, min_pairs=99, max_pairs=99)
    modes = []
    for _ in range(24):
        modes.append(governor.mode(1))
        run(governor, clock, 1, 10.0, 10.0)
    assert modes == [m for m in PATTERN * 2 for _ in range(3)]


def test_calls_made_ahead_that_pay_are_kept():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock)
    spent = run(governor, clock, 400, on_rate=13.0, off_rate=10.0)  # separate hardware: +30 %
    band = governor.bands[0]
    assert band.verdict == ON and governor.mode(1) == ON
    assert len(band.samples) < 12  # decided well before max_pairs
    assert spent[ON] > 300  # the trial was short; the rest ran with calls ahead


def test_calls_made_ahead_that_slow_the_target_are_dropped():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock)
    spent = run(governor, clock, 400, on_rate=8.5, off_rate=10.0)  # shared cores: -15 %
    assert governor.bands[0].verdict == OFF and not governor.mode(1) == ON
    assert spent[OFF] > 300


def test_a_tie_keeps_them_off_after_the_longest_trial():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock, max_pairs=10)
    run(governor, clock, 10 * 2 * governor.epoch_rounds, on_rate=10.0, off_rate=10.0, noise=0.0)
    band = governor.bands[0]
    assert len(band.samples) == 10 and band.verdict == OFF  # "on" must win by min_gain


def test_the_round_after_a_switch_is_not_counted():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock, epoch_rounds=4)
    run(governor, clock, 4, 10.0, 10.0)  # the first off epoch: its first round has no predecessor
    band = governor.bands[0]
    assert band.index == 1 and band.epoch.mode == ON
    governor.record("s0", 1, ON, 5, 1.0)  # its predecessor ran off: straddles the switch
    assert (band.epoch.rounds, band.epoch.tokens) == (1, 0)
    governor.record("s0", 1, ON, 5, 1.0)
    assert (band.epoch.rounds, band.epoch.tokens, band.epoch.seconds) == (2, 5, 1.0)
    governor.record("s1", 1, OFF, 5, 1.0)  # planned under the epoch before: not this one's
    assert band.epoch.rounds == 2


def test_a_verdict_holds_for_its_time_and_rounds_then_longer_when_it_repeats():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock, hold_s=60.0, max_hold_s=200.0, hold_factor=3)
    until_verdict(governor, clock, on_rate=13.0, off_rate=10.0)
    band = governor.bands[0]
    assert (band.verdict, band.hold_s, band.hold_rounds) == (ON, 60.0, 3 * band.trial_rounds)
    clock.now = band.decided_at + 61.0  # its time is over, its rounds are not
    last: dict[str, str] = {}
    run(governor, clock, band.hold_rounds - 1, 13.0, 10.0, last=last)
    assert governor.mode(1) == ON and band.verdict == ON
    run(governor, clock, 1, 13.0, 10.0, last=last)
    assert governor.mode(1) == PATTERN[0] and band.verdict is None  # a new trial
    until_verdict(governor, clock, on_rate=13.0, off_rate=10.0, seed=1)
    assert (band.verdict, band.hold_s, band.hold_rounds) == (ON, 120.0, 6 * band.trial_rounds)
    run(governor, clock, band.hold_rounds, 13.0, 10.0, last=last)
    clock.now = band.decided_at + 119.0  # its rounds are over, its time is not
    assert governor.mode(1) == ON
    clock.now = band.decided_at + 121.0
    assert governor.mode(1) == PATTERN[0]
    until_verdict(governor, clock, on_rate=13.0, off_rate=10.0, seed=2)
    assert (band.verdict, band.hold_s) == (ON, 200.0)  # capped
    run(governor, clock, band.hold_rounds, 13.0, 10.0, last=last)
    clock.now = band.decided_at + 201.0
    until_verdict(governor, clock, on_rate=8.0, off_rate=10.0, seed=3)  # the hardware changed
    assert (band.verdict, band.hold_s) == (OFF, 60.0)


def test_load_bands_decide_on_their_own():
    clock = Clock()
    governor = DraftAheadTrial(clock=clock)
    run(governor, clock, 300, on_rate=13.0, off_rate=10.0, load=1)
    run(governor, clock, 600, on_rate=7.0, off_rate=10.0, load=20, sessions=20)  # a busy draft tier
    assert governor.mode(1) == ON and not governor.mode(20) == ON
    assert governor.mode(1) == ON  # the verdicts do not mix
