"""Speculation under load: measure whether it still pays for the coordinator as a whole.

A session's policy (session_policy.py) prices its own rounds. Under load that view is partial: the
target batches many sessions, so one session's γ barely moves its own verify time, and where
the draft and the target share hardware (a CPU box) every draft step takes compute the batch
could have used. Speculation can then lose aggregate throughput while each session still sees
it pay (docs/benchmarks.md has the measurement).

`LoadGovernor` settles it by measurement. While at least `min_load` generations run, it runs
a trial of two epochs — speculation as the policies choose it, and plain decoding (γ = 0) for
every adaptive request — compares the tokens per second the coordinator committed in each,
and keeps the winner for `hold_s`. The first `settle_s` of an epoch are not counted: rounds
planned under the previous mode are still committing then.

What a trial costs is the time spent in the losing mode, so:
- verdicts are kept per load band (2–3, 4–7, 8–15, 16–31, … generations) and carried across
  bands one way: plain decoding winning at some load wins at any higher load (bigger batches
  only make the target's extra tokens dearer), speculation winning wins at any lower load; a
  decisive verdict (the loser at under half the winner's rate) also reaches one band the other
  way (the load halves or doubles: so decisive a margin does not turn). A load whose verdict
  follows from another's runs no trial of its own;
- a trial starts with the mode that won last time near this load (plain when nothing is known:
  under load that is the likelier winner), and the second epoch stops early once everything it
  committed since it began (switching costs included) trails the first epoch's rate by
  `early_margin`, after `min_count_s`;
- a trial whose load moves to another band ends; that band's verdict holds, or its own trial
  starts (it measured another load);
- a verdict that repeats the last one at its band, decisively, is held twice as long as that
  one was (up to `max_hold_s`): a load where speculation keeps losing by far pays for a trial
  every few minutes, not every `hold_s`;
- the load counted is the adaptive `auto` generations only: requests that fix γ or the source
  are never switched, so trials among them would compare nothing.
A single stream is left to its own policy. Requests that fix γ or the source are never
overridden.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

SPECULATE, PLAIN = "speculate", "plain"
DECISIVE = 0.5  # a loser's rate under this fraction of the winner's: the verdict reaches one band further
log = logging.getLogger(__name__)


def load_band(load: int) -> int:
    """The band of a load: 2–3 → 1, 4–7 → 2, 8–15 → 3, 16–31 → 4, … (floor of log2)."""
    return max(1, load).bit_length() - 1


def _other(mode: str) -> str:
    return PLAIN if mode == SPECULATE else SPECULATE


@dataclass
class LoadGovernor:
    min_load: int = 2          # generations running before the governor decides
    epoch_s: float = 6.0       # longest length of a trial epoch
    settle_s: float = 2.0      # its first seconds, not counted (the previous mode's rounds end)
    min_count_s: float = 2.0   # counted seconds before the second epoch may stop early
    early_margin: float = 0.1  # ... when its rate trails the first epoch's by this fraction
    hold_s: float = 120.0      # how long a verdict holds before the next trial
    max_hold_s: float = 960.0  # ... up to this, doubling while it repeats decisively
    clock: Callable[[], float] = time.monotonic
    mode: str = SPECULATE      # what adaptive requests do now
    phase: str = "idle"        # idle | trial-speculate | trial-plain | hold
    rates: dict = field(default_factory=dict)     # tokens/s measured per mode in the last trial
    verdicts: dict = field(default_factory=dict)  # band -> (winner, when decided, loser/winner rate, held for s)
    _band: int = 0             # the band of the trial running
    _first: str = PLAIN        # the mode of the trial's first epoch
    _started: float = 0.0
    _counted_from: float = 0.0
    _counting: bool = False
    _tokens: int = 0           # committed since counting began
    _epoch_tokens: int = 0     # committed since the epoch began

    def speculate(self, load: int) -> bool:
        """Whether adaptive requests may speculate now (`load`: generations running)."""
        now = self.clock()
        if load < self.min_load:  # a single stream: its own policy decides (verdicts wait)
            if self.phase.startswith("trial"):  # a trial needs the load it measures
                self.phase, self.mode = "idle", SPECULATE
            return True
        if self.phase.startswith("trial") and load_band(load) == self._band:
            self._advance(now, load)
        else:  # no trial, or one whose load moved to another band (it measured another load)
            verdict = self.verdict(load_band(load), now)
            if verdict is None:
                self._start_trial(load_band(load), now)
            else:
                self.phase, self.mode = "hold", verdict
        return self.mode == SPECULATE

    def record(self, tokens: int) -> None:
        """Tokens committed by any generation (the throughput being compared)."""
        self._tokens += tokens
        self._epoch_tokens += tokens

    def verdict(self, band: int, now: float | None = None) -> str | None:
        """The mode that holds at a load band: its own fresh verdict, else one that follows from a
        fresh verdict at another band (plain below it, speculate above it); None: try."""
        now = self.clock() if now is None else now
        fresh = {b: (mode, ratio) for b, (mode, at, ratio, hold) in self.verdicts.items() if now - at < hold}
        if band in fresh:
            return fresh[band][0]
        # a decisive verdict (the loser under DECISIVE of the winner) also holds one band beyond
        if any(mode == PLAIN and (b < band or (b == band + 1 and ratio < DECISIVE))
               for b, (mode, ratio) in fresh.items()):
            return PLAIN
        if any(mode == SPECULATE and (b > band or (b == band - 1 and ratio < DECISIVE))
               for b, (mode, ratio) in fresh.items()):
            return SPECULATE
        return None

    # ---- the trial ---------------------------------------------------------------------------

    def _lean(self, band: int) -> str:
        """The trial's first mode: the last verdict at the nearest band, else plain."""
        if not self.verdicts:
            return PLAIN
        nearest = min(self.verdicts, key=lambda b: (abs(b - band), -self.verdicts[b][1]))
        return self.verdicts[nearest][0]

    def _start_trial(self, band: int, now: float) -> None:
        self._band, self._first = band, self._lean(band)
        self.rates = {}
        log.info("load band %d: trying %s then %s", band, self._first, _other(self._first))
        self._begin(f"trial-{self._first}", self._first, now)

    def _advance(self, now: float, load: int) -> None:
        elapsed = now - self._started
        second = self.mode != self._first
        # the second epoch stops early when it trails the first even with everything it committed
        # since it began (the previous mode's last rounds included, and the cost of switching)
        trailing = (second and elapsed >= self.min_count_s
                    and self._epoch_tokens / elapsed < (1.0 - self.early_margin) * self.rates[self._first])
        if not self._counting and not trailing:
            if elapsed >= self.settle_s:
                self._counting, self._tokens, self._counted_from = True, 0, now
            return
        counted = now - self._counted_from
        rate = self._tokens / max(counted, 1e-9) if self._counting else self._epoch_tokens / elapsed
        if elapsed < self.epoch_s and not trailing:
            return
        self.rates[self.mode] = rate
        if not second:
            self._begin(f"trial-{_other(self._first)}", _other(self._first), now)
            return
        best = SPECULATE if self.rates[SPECULATE] >= self.rates[PLAIN] else PLAIN
        ratio = self.rates[_other(best)] / max(self.rates[best], 1e-9)
        hold, last = self.hold_s, self.verdicts.get(self._band)
        if last is not None and last[0] == best and last[2] < DECISIVE and ratio < DECISIVE:
            hold = min(2 * last[3], max(self.max_hold_s, self.hold_s))  # the same, by far, again
        self.verdicts[self._band] = (best, now, ratio, hold)
        log.info("load %d: %.1f tok/s speculating, %.1f plain%s: %s for %.0f s", load, self.rates[SPECULATE],
                 self.rates[PLAIN], " (stopped early)" if trailing else "", best, hold)
        self._begin("hold", best, now)

    def _begin(self, phase: str, mode: str, now: float) -> None:
        self.phase, self.mode, self._started, self._tokens, self._epoch_tokens = phase, mode, now, 0, 0
        self._counting, self._counted_from = self.settle_s <= 0, now
