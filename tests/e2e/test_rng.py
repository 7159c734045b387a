"""Per-round seeds: the draft's, the target's and a call made ahead's draws never share a seed,
in the RequestRng and in what the real services receive.

Here the e2e tests; the other tiers' are in tests/unit/test_rng.py.
"""

from __future__ import annotations

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.spies import RequestRecorder


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
