"""Whether drafting ahead pays (--draft-ahead auto): measured, not guessed.

A call made ahead (sources/draft_ahead.py) lets the draft work while the target verifies.
Where the two run on separate hardware (the chart's draft and target pools, two GPUs, a core
each) that work is free, and a round whose drafts were made ahead makes no draft call. Where
they share the same cores, the draft's forward slows the target's and drafting ahead loses
(docs/benchmarks.md has both measurements). Nothing a service reports tells the two apart
reliably (one host can give each service its own cores; two hosts can be one VM's), so
`DraftAheadTrial` measures it.

It compares, for the draft-model rounds of all sessions, the tokens committed per second of
round time with calls made ahead ("on") and without ("off"), in alternating short epochs so
both see the same text and load:
- a round counts for a mode when it and the same session's round before it ran under that
  mode: the first round after a switch straddles both (its drafts may have been made ahead
  under the other mode, or could not be);
- epochs run off, on, on, off, off, on, ... (so a drift of the text's difficulty cancels), and
  each pair of epochs gives one sample, the difference of the logarithms of its two rates;
  once `min_pairs` samples are in, the trial ends when their mean is `z` standard errors away
  from zero, at the latest after `max_pairs`; "on" wins when it is `min_gain` faster;
- a verdict holds for `hold_s` and for `hold_factor` times as many draft rounds as its trial
  took, both twice as long as the last time when the same verdict comes again (up to
  `max_hold_s`): the hardware seldom changes, so a settled coordinator seldom pays for a
  trial's losing epochs, and at any traffic the trials are a small share of the rounds;
- verdicts and trials are per load band (1, 2–3, 4–7, ... generations running, as the load
  governor's): under load the draft is busy with other sessions' calls, and calls made ahead
  compete with them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from specdec.types import DraftAhead

from coordinator.policy.load_governor import load_band

ON, OFF = DraftAhead.ON, DraftAhead.OFF  # a round's mode; AUTO is a setting only
log = logging.getLogger(__name__)


PATTERN = (OFF, ON, ON, OFF)  # the modes of a trial's epochs, repeated; epochs 2k, 2k+1 are a pair


@dataclass
class _Epoch:
    mode: DraftAhead
    rounds: int = 0        # draft rounds run under it (counted or not)
    tokens: int = 0        # committed by its counted rounds
    seconds: float = 0.0   # their round time

    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.tokens > 0 and self.seconds > 0 else None


@dataclass
class _Band:
    """One load band: its trial (epochs and per-pair samples) or its verdict."""

    epoch: _Epoch = field(default_factory=lambda: _Epoch(PATTERN[0]))
    index: int = 0                        # the epoch's number in the trial
    pair: dict = field(default_factory=dict)  # mode -> rate, of the pair of epochs running
    samples: list[float] = field(default_factory=list)  # log(rate on / rate off), one per pair
    trial_rounds: int = 0                 # draft rounds recorded during the trial
    verdict: DraftAhead | None = None     # while it holds; None during a trial
    last_verdict: DraftAhead | None = None
    decided_at: float = 0.0
    hold_s: float = 0.0                   # how long the last verdict holds (seconds) ...
    hold_rounds: int = 0                  # ... and draft rounds at the least
    held_rounds: int = 0                  # draft rounds recorded under it

    def start_trial(self) -> None:
        self.epoch, self.index, self.pair, self.samples = _Epoch(PATTERN[0]), 0, {}, []
        self.trial_rounds, self.verdict = 0, None

    def holds(self, now: float) -> bool:
        return self.verdict is not None and (now - self.decided_at < self.hold_s
                                             or self.held_rounds < self.hold_rounds)


@dataclass
class DraftAheadTrial:
    """Whether draft-model rounds make a call ahead now: `mode(load)` in a round, `record` after
    it. `setting` ON / OFF fixes the answer; AUTO measures (see the module docstring)."""

    setting: DraftAhead = DraftAhead.AUTO
    epoch_rounds: int = 6      # draft rounds per epoch (the first after a switch does not count)
    min_pairs: int = 4         # pairs of epochs before a trial may end
    max_pairs: int = 24        # ... and when it ends at the latest
    z: float = 2.0             # a trial ends once the mean difference is this many standard errors
    min_gain: float = 0.03     # calls made ahead must be this much faster to be kept
    hold_s: float = 600.0      # how long a verdict holds before the next trial ...
    hold_factor: int = 10      # ... and for this many times the draft rounds its trial took
    max_hold_s: float = 4800.0  # the hold doubles while the same verdict comes again, up to this
    clock: Callable[[], float] = time.monotonic
    bands: dict[int, _Band] = field(default_factory=dict)
    _last_mode: dict[str, DraftAhead] = field(default_factory=dict)  # session -> its last draft round's

    def __post_init__(self) -> None:
        if self.setting not in tuple(DraftAhead):
            raise ValueError(f"draft_ahead must be one of {', '.join(DraftAhead)}, got {self.setting!r}")
        self.setting = DraftAhead(self.setting)

    def mode(self, load: int) -> DraftAhead:
        """Whether a draft-model round with `load` generations running makes a call ahead: ON | OFF."""
        if self.setting != DraftAhead.AUTO:
            return self.setting
        band = self._band(load)
        if band.holds(self.clock()):
            return band.verdict
        if band.verdict is not None:  # the hold is over
            band.start_trial()
            log.info("draft ahead, load band %d: trying again", load_band(load))
        return band.epoch.mode

    def record(self, session_id: str, load: int, mode: DraftAhead, tokens: int, seconds: float) -> None:
        """A draft-model round of `session_id` ran under `mode`, committed `tokens` in `seconds`."""
        previous, self._last_mode[session_id] = self._last_mode.get(session_id), mode
        if self.setting != DraftAhead.AUTO:
            return
        band = self._band(load)
        epoch = band.epoch
        if band.verdict is not None:
            band.held_rounds += 1
            return
        if mode != epoch.mode:
            return  # planned under the other epoch: not this one's
        band.trial_rounds += 1
        epoch.rounds += 1
        if previous == mode and tokens > 0 and seconds > 0:
            epoch.tokens += tokens
            epoch.seconds += seconds
        if epoch.rounds >= self.epoch_rounds:
            self._end_epoch(band, load)

    def forget(self, session_id: str) -> None:
        """The session's request ended: its next round starts afresh."""
        self._last_mode.pop(session_id, None)

    # ---- the trial ----------------------------------------------------------------------------

    def _band(self, load: int) -> _Band:
        return self.bands.setdefault(load_band(max(1, load)), _Band())

    def _end_epoch(self, band: _Band, load: int) -> None:
        band.pair[band.epoch.mode] = band.epoch.rate()
        band.index += 1
        band.epoch = _Epoch(PATTERN[band.index % len(PATTERN)])
        if band.index % 2 == 0:  # a pair is complete
            on, off = band.pair.get(ON), band.pair.get(OFF)
            band.pair = {}
            if on is not None and off is not None:
                band.samples.append(math.log(on / off))
            self._maybe_decide(band, load)

    def _maybe_decide(self, band: _Band, load: int) -> None:
        samples, pairs = band.samples, len(band.samples)
        if pairs < self.min_pairs:
            return
        mean = sum(samples) / pairs
        spread = math.sqrt(sum((s - mean) ** 2 for s in samples) / (pairs - 1))
        if abs(mean) < self.z * spread / math.sqrt(pairs) and pairs < self.max_pairs:
            return
        verdict = ON if mean > math.log1p(self.min_gain) else OFF
        hold = self.hold_s
        if band.last_verdict == verdict:  # the same again: the hardware did not change
            hold = min(2 * band.hold_s, max(self.max_hold_s, self.hold_s))
        band.verdict, band.last_verdict, band.decided_at, band.hold_s = verdict, verdict, self.clock(), hold
        band.hold_rounds, band.held_rounds = round(self.hold_factor * band.trial_rounds * hold / self.hold_s), 0
        log.info("draft ahead, load band %d: %+.0f%% tokens/s with calls made ahead (%d pairs of epochs): "
                 "%s for %.0f s and %d draft rounds", load_band(load), 100 * math.expm1(mean), pairs, verdict,
                 hold, band.hold_rounds)
