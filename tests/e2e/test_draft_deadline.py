"""A slow draft costs a few rounds, never a whole request: a replica's first (cold) Propose has
--draft-cold-deadline-s, and a request whose draft call timed out backs off for 1, 2, 4, ...
rounds, then uses the draft again. The target decides every token: the output never changes.

Here the e2e tests; the other tiers' are in tests/unit/test_draft_deadline.py.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.spies import DelayedCalls, held_worker

WARM_S = 1.0  # the warm calls' deadline in these tests (--draft-timeout-s)
SLOW_S = 1.6  # how long the slow call takes: past WARM_S, well within the cold deadline
# the draft model proposes every round, γ fixed: a round without drafts is one the draft missed
REQUEST = dict(token_ids=[3, 7, 5, 3, 7], max_new_tokens=40, ignore_eos=True,
               proposer=coordinator_pb2.PROPOSER_DRAFT, num_speculative_tokens=3)


def target_only(cluster: Cluster) -> list[int]:
    return list(cluster.complete(**{**REQUEST, "proposer": coordinator_pb2.PROPOSER_NONE}).token_ids)


def test_a_slow_first_draft_call_still_speculates_from_the_first_round(near_draft, small_vocab_models):
    """The draft's model is busy when the first request arrives: its first Propose waits past the
    warm deadline, within the cold one, and every round of the request uses the draft."""
    config = {"draft_timeout_s": WARM_S, "draft_cold_deadline_s": 30.0}
    with Cluster(near_draft, small_vocab_models["target"], coordinator=config) as cluster, \
            ThreadPoolExecutor(1) as pool:
        servicer = cluster.draft_servicer
        with held_worker(servicer):
            pending = pool.submit(cluster.complete, **REQUEST)
            give_up = time.monotonic() + 30
            while servicer.worker.queue_depth < 1:  # the first Propose waits for the model
                assert time.monotonic() < give_up, "the first Propose never reached the draft"
                time.sleep(0.01)
            time.sleep(SLOW_S)
        first = pending.result(timeout=60)
        stats = first.stats
        assert stats.fallback_rounds == 0 and stats.draft_seconds > WARM_S  # slow, and waited for
        assert stats.draft_rounds == stats.rounds and stats.gamma_per_round[0] == 3
        assert stats.accepted_tokens > 0 and stats.tokens_per_round > 1
        assert list(first.token_ids) == target_only(cluster)


def test_a_draft_that_timed_out_mid_request_is_used_again_in_that_request(near_draft, small_vocab_models):
    """The 4th Propose of the request is slower than the warm deadline: that round runs
    target-only, the next one skips the draft, and the rounds after use it again. The replica
    answered its health check meanwhile, so it was not marked failed: the next request uses
    the draft from its first round although --draft-retry-s is long."""
    config = {"draft_timeout_s": WARM_S, "draft_cold_deadline_s": 0.0, "draft_retry_s": 600.0}
    with Cluster(near_draft, small_vocab_models["target"], coordinator=config,
                 interceptors=[DelayedCalls("Propose", {4: SLOW_S})]) as cluster:
        response = cluster.complete(**REQUEST)
        gammas = list(response.stats.gamma_per_round)
        assert gammas[:3] == [3, 3, 3] and gammas[3:5] == [0, 0], gammas  # timed out, then one skipped
        assert response.stats.fallback_rounds == 2
        assert 0 not in gammas[5:-1] and len(gammas) > 6, gammas  # the draft is back (the last round may be capped)
        assert list(response.token_ids) == target_only(cluster)
        after = cluster.complete(**REQUEST)
        assert after.stats.fallback_rounds == 0 and after.stats.gamma_per_round[0] == 3
