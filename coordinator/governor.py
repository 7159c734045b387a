"""Speculation under load: measure whether it still pays for the coordinator as a whole.

A session's policy (policy.py) prices its own rounds. Under load that view is partial: the
target batches many sessions, so one session's γ barely moves its own verify time, and where
the draft and the target share hardware (a CPU box) every draft step takes compute the batch
could have used. Speculation can then lose aggregate throughput while each session still sees
it pay (measured on the 2-core dev machine with the real pair: 16 sessions at the default
policy made 0.6× the tokens per second of γ = 0).

`LoadGovernor` settles it by measurement. While at least `min_load` generations run, it
alternates two trial epochs — speculation as the policies choose it, then plain decoding
(γ = 0) for every adaptive request — compares the tokens per second the coordinator committed
in each, and keeps the winner for `hold_s` before trying again. The first `settle_s` of an
epoch are not counted: rounds planned under the previous mode are still committing then. A
single stream is left to its own policy. Requests that fix γ or the proposer are never
overridden.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

SPECULATE, PLAIN = "speculate", "plain"
log = logging.getLogger(__name__)


@dataclass
class LoadGovernor:
    min_load: int = 2          # generations running before the governor decides
    epoch_s: float = 6.0       # length of each trial epoch
    settle_s: float = 2.0      # its first seconds, not counted (the previous mode's rounds end)
    hold_s: float = 60.0       # how long the winner holds before the next trial
    clock: Callable[[], float] = time.monotonic
    mode: str = SPECULATE      # what adaptive requests do now
    phase: str = "idle"        # idle | trial-speculate | trial-plain | hold
    rates: dict = field(default_factory=dict)  # tokens/s measured per mode in the last trial
    _started: float = 0.0
    _counted_from: float = 0.0
    _counting: bool = False
    _tokens: int = 0

    def speculate(self, load: int) -> bool:
        """Whether adaptive requests may speculate now (`load`: generations running)."""
        now = self.clock()
        if load < self.min_load:  # a single stream: its own policy decides (a held verdict waits)
            if self.phase.startswith("trial"):  # a trial needs the load it measures
                self.phase, self.mode = "idle", SPECULATE
            return True
        if self.phase == "idle" or (self.phase == "hold" and now - self._started >= self.hold_s):
            self._begin("trial-speculate", SPECULATE, now)
        elif self.phase.startswith("trial") and not self._counting and now - self._started >= self.settle_s:
            self._counting, self._tokens, self._counted_from = True, 0, now
        elif self.phase.startswith("trial") and now - self._started >= self.epoch_s:
            self.rates[self.mode] = self._tokens / max(now - self._counted_from, 1e-9)
            if self.phase == "trial-speculate":
                self._begin("trial-plain", PLAIN, now)
            else:
                best = SPECULATE if self.rates[SPECULATE] >= self.rates[PLAIN] else PLAIN
                log.info("load %d: %.1f tok/s speculating, %.1f plain: %s for %.0f s", load,
                         self.rates[SPECULATE], self.rates[PLAIN], best, self.hold_s)
                self._begin("hold", best, now)
        return self.mode == SPECULATE

    def record(self, tokens: int) -> None:
        """Tokens committed by any generation (the throughput being compared)."""
        self._tokens += tokens

    def _begin(self, phase: str, mode: str, now: float) -> None:
        self.phase, self.mode, self._started, self._tokens = phase, mode, now, 0
        self._counting, self._counted_from = self.settle_s <= 0, now
