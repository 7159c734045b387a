"""Rollback and cache misses: a restarted service rebuilds its cache; output is unchanged."""

from __future__ import annotations

import pytest

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster

TURNS = ["def fibonacci(n):", "\n# and now the loop\nfor i in range(3):"]


def run_session(cluster: Cluster, restart=None, **sampling):
    """Two requests of one session; optionally restart a service between them. The draft model
    proposes every round (prompt-lookup rounds would leave the draft more to catch up on)."""
    draft = coordinator_pb2.PROPOSER_DRAFT
    first = cluster.complete(prompt=TURNS[0], max_new_tokens=20, num_speculative_tokens=3,
                             ignore_eos=True, proposer=draft, **sampling)
    if restart:
        restart()
    second = cluster.complete(session_id=first.session_id, prompt=TURNS[1], max_new_tokens=20,
                              num_speculative_tokens=3, ignore_eos=True, proposer=draft, **sampling)
    return first, second


@pytest.mark.parametrize("which", ["target", "draft"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=5)],
                         ids=["greedy", "seeded-sampling"])
def test_restart_between_requests_keeps_output(models, which, sampling):
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"]) as cluster:
        ref_first, ref_second = run_session(cluster, **sampling)
        restart = cluster.restart_target if which == "target" else cluster.restart_draft
        first, second = run_session(cluster, restart=restart, **sampling)
        assert list(first.token_ids) == list(ref_first.token_ids)
        assert list(second.token_ids) == list(ref_second.token_ids)
        assert second.text == ref_second.text
        assert ref_second.stats.cache_misses == 0
        assert second.stats.cache_misses == 1
        history = len(cluster.stub.GetSession(
            coordinator_pb2.GetSessionRequest(session_id=second.session_id)).token_ids)
        turn2_prompt = second.stats.prompt_tokens
        restarted_prefill = getattr(second.stats, f"{which}_prefill_tokens")
        other = "draft" if which == "target" else "target"
        # the restarted service got the whole history again; the other one only what it lacked:
        # the new prompt plus the last committed token (the draft: possibly its last draft too)
        assert restarted_prefill == history - 20
        lacked = {"target": 1, "draft": 2}
        assert getattr(ref_second.stats, f"{which}_prefill_tokens") <= turn2_prompt + lacked[which]
        assert getattr(second.stats, f"{other}_prefill_tokens") <= turn2_prompt + lacked[other]


def test_continuation_appends_and_reuses_caches(llama_cluster):
    # the draft proposes every round, so it holds all but the last token or two of turn 1
    draft = dict(proposer=coordinator_pb2.PROPOSER_DRAFT, num_speculative_tokens=3)
    first = llama_cluster.complete(prompt=TURNS[0], max_new_tokens=10, ignore_eos=True, **draft)
    second = llama_cluster.complete(session_id=first.session_id, prompt=TURNS[1], max_new_tokens=10,
                                    ignore_eos=True, **draft)
    session = llama_cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
    tokens = list(session.token_ids)
    assert session.requests == 2
    assert tokens[first.stats.prompt_tokens: first.stats.prompt_tokens + 10] == list(first.token_ids)
    assert tokens[-10:] == list(second.token_ids)
    assert len(tokens) == first.stats.prompt_tokens + 10 + second.stats.prompt_tokens + 10
    assert session.stats.generated_tokens == 20 and session.stats.rounds == first.stats.rounds + second.stats.rounds
    # only the new tokens are prefilled on turn 2 (plus at most the one token each service lacked)
    assert second.stats.target_prefill_tokens <= second.stats.prompt_tokens + 1
    assert second.stats.draft_prefill_tokens <= second.stats.prompt_tokens + 2
    deleted = llama_cluster.stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(session_id=first.session_id))
    assert deleted.deleted
    assert first.session_id not in llama_cluster.target_servicer.engine.caches
    assert first.session_id not in llama_cluster.draft_servicer.engine.caches


def test_draft_refusing_a_token_falls_back_to_target_only(models, tmp_path):
    """A draft whose embedding is smaller than the target's answers INVALID_ARGUMENT once the
    target emits an id it cannot take: those rounds run target-only and the output is unchanged."""
    from specdec_cli import tiny
    from tests.e2e.test_continuation import target_only

    draft = tiny.build_model(tmp_path / "small-draft", tiny.byte_level_tokenizer(), "llama", seed=12,
                             layers=1, vocab_size=200)
    target = models["llama"]["target"]
    prompt = [70, 71, 72, 84, 85, 86]  # ids both models take
    expected = target_only(target, prompt, 60)
    assert max(expected) >= 200, "the target never emits an id past the draft's embedding: no fallback to see"
    with Cluster(str(draft), target, coordinator={"draft_retry_s": 0.0}) as cluster:
        response = cluster.complete(token_ids=prompt, max_new_tokens=60, num_speculative_tokens=3,
                                    ignore_eos=True)
    assert list(response.token_ids) == expected
    assert response.stats.fallback_rounds > 0 and response.stats.draft_tokens > 0
