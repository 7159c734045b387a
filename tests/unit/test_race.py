"""Two coordinators racing on one session never produce a history that differs from target-only greedy.

Here the unit tests; the other tiers' are in tests/e2e/test_race.py. The tier split shares one description: see tests/e2e/test_race.py.
"""

from __future__ import annotations
from tests.e2e.test_race import PROMPT, explained


def test_the_check_can_fail():
    history = PROMPT + [10, 4, 9, 9, 6, 11, 9]
    pred = [0] * len(history)  # pred[i] = the token after history[:i + 1]
    pred[6] = pred[7] = pred[10] = 9
    assert explained(history, pred)
    assert not explained(history[:-1] + [8], pred)  # a generated token the target would not choose
