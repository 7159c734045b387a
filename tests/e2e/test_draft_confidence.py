"""The draft stops early where it is unsure (`min_confidence`).

Here the e2e tests; the other tiers' are in tests/unit/test_draft_confidence.py and
tests/service/test_draft_confidence.py. The tier split shares one description: see tests/unit/test_draft_confidence.py.
"""

from __future__ import annotations

import grpc
import pytest

from specdec.v1 import draft_pb2, draft_pb2_grpc
from tests.cluster import Cluster
from tests.e2e.test_draft_hints import GREEDY, PROMPT
from tests.e2e.test_sources import IDS_PROMPTS, proposer, target_only


def test_bad_min_confidence_is_invalid_argument(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        for bad in (1.0, -0.1, float("nan")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Propose(draft_pb2.ProposeRequest(session_id="bad", new_tokens=PROMPT, num_speculative_tokens=2,
                                                      sampling=GREEDY, min_confidence=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "min_confidence" in err.value.details()


@pytest.mark.parametrize("threshold", [0.0, 0.999999], ids=["off", "on"])
def test_adaptive_rounds_stop_early_and_stay_greedy_exact(small_vocab_models, threshold):
    """Adaptive γ with a threshold no token of the tiny draft reaches: every draft round ends
    after its first token, and output is still the target's; off, the fresh coordinator's
    warm-up round runs its γ = 6. A fixed γ is never cut."""
    target, draft_dir = small_vocab_models["target"], small_vocab_models["draft"]
    config = {"draft_min_confidence": threshold, "default_num_speculative_tokens": 6, "draft_hints": False}
    with Cluster(draft_dir, target, coordinator=config) as cluster:
        for n, ids in enumerate(IDS_PROMPTS):
            expected = target_only(target, ids, 24)
            response = cluster.complete(token_ids=ids, max_new_tokens=24, ignore_eos=True,
                                        proposer=proposer("draft"))
            assert list(response.token_ids) == expected
            drafted = [g for g in response.stats.gamma_per_round if g]
            if threshold:
                assert drafted and set(drafted) == {1}
            elif n == 0:
                assert drafted[0] == 6  # the warm-up round, asked for 6, drafted 6
            fixed = cluster.complete(token_ids=ids, max_new_tokens=24, ignore_eos=True,
                                     proposer=proposer("draft"), num_speculative_tokens=5)
            assert list(fixed.token_ids) == expected
            assert fixed.stats.gamma_per_round[0] == 5  # a fixed γ is never cut
