"""Per-round seeds: the draft's, the target's and a call made ahead's draws never share a seed,
in the RequestRng and in what the real services receive."""

from __future__ import annotations

import pytest

from specdec.rng import RequestRng
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.spies import RequestRecorder


@pytest.mark.unit
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


@pytest.mark.unit
def test_round_seeds_skip_repeats_of_the_raw_stream():
    rng = _RepeatingRng([5, 5, 6, 5, 6, 7, 7, 8, 9, 8, 10])
    assert rng.round_seeds() == (5, 6, 7)
    assert rng.round_seeds() == (8, 9, 10)


def _rounds(calls) -> list[tuple[int | None, int]]:
    """Pair each Verify with the Propose before it: [(draft seed, target seed)]; the draft seed is
    None in a target-only round (the last round of a request may have no room for drafts)."""
    pairs, pending = [], None
    for method, request in calls:
        if method == "Propose":
            assert pending is None, "two Propose calls without a Verify between them"
            pending = request.seed
        elif method == "Verify":
            pairs.append((pending, request.seed))
            pending = None
    return pairs


@pytest.mark.e2e
def test_services_receive_distinct_seeds_every_round(small_vocab_models):
    recorder = RequestRecorder("Propose", "Verify")
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"],
                 interceptors=[recorder]) as cluster:
        # a fixed γ from the draft alone: the rounds do not depend on what the policy learnt
        # (under auto, whether prompt lookup proposes does; docs/design.md)
        request = dict(token_ids=[3, 7, 5], max_new_tokens=12, num_speculative_tokens=2, temperature=1.0,
                       ignore_eos=True, proposer=coordinator_pb2.PROPOSER_DRAFT)
        seen = []
        for seed in (1, 2):
            cluster.complete(seed=seed, **request)
            seen.append(_rounds(recorder.take()))
        cluster.complete(seed=1, **request)
        repeat = _rounds(recorder.take())
    for rounds in seen:
        assert len(rounds) >= 4  # 12 tokens, at most 3 per round
        assert sum(d is not None for d, _ in rounds) >= 3  # most rounds speculate
        for draft_seed, target_seed in rounds:
            assert draft_seed != target_seed
        seeds = [s for pair in rounds for s in pair if s is not None]
        assert len(set(seeds)) == len(seeds), "a seed was reused across rounds"
    assert seen[0] == repeat  # a seeded request sends the same seeds again
    assert seen[0][0] != seen[1][0]  # and another seed sends others


@pytest.mark.unit
def test_a_call_made_ahead_never_draws_with_the_next_rounds_seed():
    """The call made ahead during a round draws with that round's `ahead` seed, never with the
    next round's draft seed: the next round calls the draft exactly when the guess made ahead
    was wrong, and replaying the guess's draws would bias its first draft (issue: drafting ahead
    reused the next round's seed)."""
    rng = RequestRng(7)
    rounds = [rng.round_seeds() for _ in range(100)]
    for this, after in zip(rounds, rounds[1:]):
        assert this.ahead not in (this.draft, this.target, after.draft, after.target)
