"""Per-round seeds: the draft's, the target's and a call made ahead's draws never share a seed,
in the RequestRng and in what the real services receive.

Here the unit tests; the other tiers' are in tests/e2e/test_rng.py.
"""

from __future__ import annotations

from specdec.rng import RequestRng


def test_round_seeds_are_distinct_and_reproducible():
    rng = RequestRng(7)
    rounds = [rng.round_seeds() for _ in range(500)]
    seeds = [s for triple in rounds for s in triple]
    assert len(seeds) == 3 * 500 and len(set(seeds)) == len(seeds)  # per call and per round
    again = RequestRng(7)
    assert [again.round_seeds() for _ in range(500)] == rounds
    assert RequestRng(8).round_seeds() != rounds[0]


class _RepeatingRng(RequestRng):
    """A seed stream that repeats itself: round_seeds must still never hand out a seed twice."""

    def __init__(self, stream: list[int]):
        super().__init__(0)
        self._stream = iter(stream)

    def next_seed(self) -> int:
        return next(self._stream)


def test_round_seeds_skip_repeats_of_the_raw_stream():
    rng = _RepeatingRng([5, 5, 6, 5, 6, 7, 7, 8, 9, 8, 10])
    assert rng.round_seeds() == (5, 6, 7)
    assert rng.round_seeds() == (8, 9, 10)


def test_a_call_made_ahead_never_draws_with_the_next_rounds_seed():
    """The call made ahead during a round draws with that round's `ahead` seed, never with the
    next round's draft seed: the next round calls the draft exactly when the guess made ahead
    was wrong, and replaying the guess's draws would bias its first draft (issue: drafting ahead
    reused the next round's seed)."""
    rng = RequestRng(7)
    rounds = [rng.round_seeds() for _ in range(100)]
    for this, after in zip(rounds, rounds[1:]):
        assert this.ahead not in (this.draft, this.target, after.draft, after.target)
