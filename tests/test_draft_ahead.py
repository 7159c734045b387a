"""Drafting ahead (the coordinator's --draft-ahead): while a round is verified, the draft goes
on past that round's drafts, its first token a guess of the target's bonus token; when the
target accepts every draft and its bonus is the guess, the next round verifies the rest with
no draft call.

Greedy, float64: output equals the target's alone, with the target as its own draft (every
guess right: most rounds are drafted ahead, and the draft is called about once per two
rounds) and with an unrelated draft (guesses mostly wrong: the calls made ahead are dropped
and the draft's cache rolls back on the next call), at adaptive and fixed γ; a fixed γ is
still exactly γ. Sampled output over all requests, drafting ahead on, follows the target's
distribution: tests/test_sampled_sources.py.
"""

from __future__ import annotations

import grpc
import pytest

from coordinator.policy.draft_ahead_trial import DraftAheadTrial
from coordinator.policy.speculation import FixedCosts
from specdec.types import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.cluster import Cluster
from tests.procs import Coordinator, ServiceProcess, start_together
from tests.spies import RequestRecorder
from tests.test_sources import IDS_PROMPTS, proposer, target_only

AHEAD = {"draft_ahead": "on", "draft_hints": False, "draft_min_confidence": 0.0}  # the 12-word draft is never sure


@pytest.mark.e2e
@pytest.mark.parametrize("gamma", [None, 3], ids=["adaptive", "fixed3"])
def test_greedy_with_the_target_as_draft_skips_draft_calls(small_vocab_models, gamma):
    target = small_vocab_models["target"]
    recorder = RequestRecorder("Propose")
    with Cluster(target, target, coordinator=AHEAD, interceptors=[recorder]) as cluster:
        for ids in IDS_PROMPTS:
            expected = target_only(target, ids, 30)
            recorder.calls.clear()
            fields = {} if gamma is None else {"num_speculative_tokens": gamma}
            response = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True,
                                        proposer=proposer("draft"), **fields)
            assert list(response.token_ids) == expected
            stats = response.stats
            assert stats.accepted_tokens == stats.draft_tokens  # the same model: every draft taken
            assert stats.draft_ahead_rounds >= stats.draft_rounds // 2 > 0
            # every draft round calls Propose once, or drafted ahead (then its call was made the
            # round before); the last round's call made ahead is never used
            assert len(recorder.calls) == stats.draft_rounds - stats.draft_ahead_rounds + stats.draft_ahead_calls
            if gamma is not None:
                assert set(stats.gamma_per_round[:-1]) == {gamma}  # the last may be cut by max_new_tokens


@pytest.mark.e2e
@pytest.mark.parametrize("gamma", [None, 4], ids=["adaptive", "fixed4"])
def test_greedy_with_an_unrelated_draft_stays_exact(small_vocab_models, gamma):
    target, draft = small_vocab_models["target"], small_vocab_models["draft"]
    with Cluster(draft, target, coordinator=AHEAD) as cluster:
        for ids in IDS_PROMPTS + [[5, 5, 1, 8]]:
            fields = {} if gamma is None else {"num_speculative_tokens": gamma}
            response = cluster.complete(token_ids=ids, max_new_tokens=40, ignore_eos=True,
                                        proposer=proposer("draft"), **fields)
            assert list(response.token_ids) == target_only(target, ids, 40)
            stats = response.stats
            assert stats.cache_misses == 0  # the dropped calls made ahead left the draft consistent
            assert stats.draft_ahead_calls > stats.draft_ahead_rounds  # some guesses were wrong


@pytest.mark.e2e
def test_auto_switches_mid_stream_and_stays_exact(small_vocab_models):
    """--draft-ahead auto: the governor's epochs switch calls made ahead on and off within one
    request (here every few rounds, for good: the verdict never comes); output is unchanged."""
    target = small_vocab_models["target"]
    coordinator = {**AHEAD, "draft_ahead": "auto", "max_num_speculative_tokens": 4,  # many rounds
                   "tiers_share_cores": "no"}  # as if on separate cores: auto measures
    with Cluster(target, target, coordinator=coordinator) as cluster:
        engine = cluster.coordinator.round_loop
        engine.draft_model.trial = DraftAheadTrial(epoch_rounds=2, min_pairs=10**6, max_pairs=10**6)
        # the policy prices the draft as cheap: the target as its own draft costs a target step,
        # and measured it would (rightly, on timing noise) drop to rounds with no draft at all
        engine.speculation.costs = FixedCosts(0.2)
        calls = rounds = 0
        for ids in IDS_PROMPTS:
            response = cluster.complete(token_ids=ids, max_new_tokens=40, ignore_eos=True,
                                        proposer=proposer("draft"))
            assert list(response.token_ids) == target_only(target, ids, 40)
            stats = response.stats
            assert stats.draft_ahead_rounds > 0
            calls, rounds = calls + stats.draft_ahead_calls, rounds + stats.draft_rounds
        # half the epochs make calls ahead (always on would make one in nearly every round)
        assert 0.25 * rounds < calls < 0.75 * rounds


@pytest.mark.e2e
@pytest.mark.parametrize("pinned, fields", [({}, {"num_speculative_tokens": 3}), ({"draft_cost_ratio": 0.2}, {})],
                         ids=["fixed-gamma", "pinned-cost-ratio"])
def test_auto_leaves_reproducible_rounds_alone(small_vocab_models, pinned, fields):
    """Under auto, a request that fixes γ and a coordinator that pins c keep their rounds (and so
    a seeded request's draws) reproducible: no call is made ahead, nothing is measured."""
    target = small_vocab_models["target"]
    with Cluster(target, target, coordinator={**AHEAD, "draft_ahead": "auto", "tiers_share_cores": "no",
                                              **pinned}) as cluster:
        cluster.coordinator.round_loop.draft_model.trial = DraftAheadTrial(epoch_rounds=1, min_pairs=10**6, max_pairs=10**6)
        response = cluster.complete(token_ids=IDS_PROMPTS[0], max_new_tokens=30, ignore_eos=True,
                                    proposer=proposer("draft"), **fields)
        assert response.stats.draft_rounds > 2 and response.stats.draft_ahead_calls == 0
        assert not cluster.coordinator.round_loop.draft_model.trial.bands


@pytest.mark.e2e
def test_auto_never_drafts_ahead_on_shared_cores(small_vocab_models):
    """Both services run in this process, on the same cores: under auto no call is made ahead
    (the draft would slow the verification it ran beside) and no trial runs; `on` still does."""
    target = small_vocab_models["target"]
    for setting, ahead in (("auto", False), ("on", True)):
        with Cluster(target, target, coordinator={**AHEAD, "draft_ahead": setting}) as cluster:
            assert not cluster.coordinator.round_loop.draft_model.beside_verification
            cluster.coordinator.round_loop.speculation.costs = FixedCosts(0.2)  # speculating pays (as above)
            response = cluster.complete(token_ids=IDS_PROMPTS[0], max_new_tokens=30, ignore_eos=True,
                                        proposer=proposer("draft"))
            assert list(response.token_ids) == target_only(target, IDS_PROMPTS[0], 30)
            assert response.stats.draft_rounds > 2
            assert (response.stats.draft_ahead_calls > 0) is ahead
            assert not cluster.coordinator.round_loop.draft_model.trial.bands


@pytest.mark.e2e
def test_a_round_drafted_ahead_sends_the_q_of_its_own_position(small_vocab_models, near_draft):
    """The Verify of a round drafted ahead carries, for its draft, the draft's q at the history
    it continues (tokens 1 and 2 committed): the very q a Propose on that history reports."""
    target = small_vocab_models["target"]
    params, prompt = SamplingParams(temperature=0.8), [3, 7, 5]
    recorder = RequestRecorder("Verify")
    checked = 0
    with Cluster(near_draft, target, coordinator=AHEAD, interceptors=[recorder]) as cluster, \
            grpc.insecure_channel(f"127.0.0.1:{cluster.draft_port}") as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        for seed in range(40):
            recorder.calls.clear()
            response = cluster.complete(token_ids=prompt, max_new_tokens=4, num_speculative_tokens=1,
                                        proposer=proposer("draft"), temperature=params.temperature,
                                        seed=seed, ignore_eos=True)
            if not response.stats.draft_ahead_rounds:
                continue
            second_round = recorder.calls[1][1]
            history = prompt + list(response.token_ids[:2])
            fresh = draft.Propose(draft_pb2.ProposeRequest(
                session_id=f"probe{seed}", new_tokens=history, num_speculative_tokens=1,
                sampling=common_pb2.SamplingParams(temperature=params.temperature), seed=seed))
            assert len(second_round.draft_tokens) == 1  # γ = 1, drafted ahead
            sent, reported = second_round.draft_probs[0], fresh.draft_probs[0]
            assert dict(zip(sent.token_ids, sent.probs)) == pytest.approx(dict(zip(reported.token_ids, reported.probs)))
            checked += 1
    assert checked >= 3


@pytest.mark.process
def test_a_draft_killed_mid_stream_with_calls_made_ahead(models):
    """The draft process dies while calls are made ahead (the target as its own draft: nearly
    every round has one in flight): the rounds fall back to the target alone and the output is
    the same as without the fault."""
    target = models["llama"]["target"]
    draft, verifier = start_together(ServiceProcess("draft", target), ServiceProcess("target", target))
    coordinator = Coordinator(draft.address, verifier.address, draft_retry_s=0.5, **AHEAD)
    request = dict(prompt="def fibonacci(n):", max_new_tokens=200, num_speculative_tokens=3, ignore_eos=True)
    try:
        first = coordinator.complete(**request)
        assert first.stats.draft_ahead_rounds > 0
        tokens, last = [], None
        for i, chunk in enumerate(coordinator.stream(**request)):
            tokens.extend(chunk.token_ids)
            last = chunk
            if i == 1:
                draft.kill()
        assert tokens == list(first.token_ids)
        assert last.stats.fallback_rounds > 0
    finally:
        coordinator.stop()
        draft.stop()
        verifier.stop()
