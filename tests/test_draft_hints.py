"""Prompt-lookup hints checked by the draft model (proposer auto).

The draft runs the hints in its first forward and keeps the leading ones it agrees with:
greedy, exactly its own greedy continuation; sampled, each token still a draw from the q it
reports (chi-square); its cache afterwards holds exactly the kept tokens; bad hints are
INVALID_ARGUMENT; end to end, greedy output equals the target's and hints were kept.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from specdec.config import DraftConfig
from specdec.fingerprint import fingerprint
from specdec.runtime.engines import engine_from_config
from specdec.types import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.runtime.drafting import HostDrafting
from tests.cluster import Cluster
from tests.test_sources import IDS_PROMPTS, proposer, target_only
from tests.test_sampling import chi2_pvalue

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
PROMPT = [5, 6, 7, 8, 9]


def propose(draft, session: str, gamma: int, hints=(), prefix: list[int] | None = None,
            new_tokens: list[int] = PROMPT):
    prefix = prefix or []
    return draft.Propose(draft_pb2.ProposeRequest(
        session_id=session, prefix_len=len(prefix), prefix_hash=fingerprint(prefix) if prefix else 0,
        new_tokens=new_tokens, num_speculative_tokens=gamma, sampling=GREEDY, seed=1, hint_tokens=list(hints)))


@pytest.mark.e2e
def test_greedy_hints_are_kept_while_they_are_the_drafts_own_tokens(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        own = list(propose(draft, "plain", 7).draft_tokens)  # the draft's greedy continuation

        right = propose(draft, "right", 2, hints=own[:4])
        assert list(right.draft_tokens) == own[:6]  # 4 hints kept + 2 steps of its own
        assert right.num_hint_tokens_kept == 4
        assert right.cached_len == len(PROMPT) + 6 - 1

        wrong_hint = (own[2] + 1) % 300 + 1
        wrong = propose(draft, "wrong", 3, hints=[own[0], own[1], wrong_hint, own[3]])
        assert wrong.num_hint_tokens_kept == 2  # the third hint is not its argmax
        assert list(wrong.draft_tokens) == own[:5]  # its own token replaces it, then 2 more steps
        assert wrong.cached_len == len(PROMPT) + 5 - 1  # the rejected hints left the cache

        # the caches hold exactly the kept tokens: continuing after the target accepted some
        # gives what the plain session gives
        for session, response in (("right", right), ("wrong", wrong)):
            accepted = 3
            history = PROMPT + own[:accepted]
            again = propose(draft, session, 2, prefix=history, new_tokens=[own[accepted]])
            plain = propose(draft, "plain", 2, prefix=history, new_tokens=[own[accepted]])
            assert list(again.draft_tokens) == list(plain.draft_tokens) == own[accepted + 1:accepted + 3]


@pytest.mark.e2e
def test_bad_hints_are_invalid_argument(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        limit = draft.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest()).info.max_speculative_tokens
        with pytest.raises(grpc.RpcError) as err:
            propose(draft, "bad-id", 2, hints=[5, 10 ** 6])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hint_tokens" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            propose(draft, "too-many", 2, hints=[5] * (limit - 1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_speculative_tokens + hint_tokens" in err.value.details()


@pytest.mark.service
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["t1.0", "t0.7-topk5"])
def test_sampled_hint_positions_are_draws_from_the_reported_q(small_vocab_models, params):
    """With a hint at the first position, the first proposed token is still distributed as q:
    kept with probability q(hint), else drawn from q without it."""
    engine = engine_from_config(DraftConfig(model=small_vocab_models["draft"], dtype="float64"))
    proposer_ = HostDrafting(engine, 32)
    prompt = [3, 7, 5, 3]
    plain = proposer_.propose_batch([proposer_.call("q", 0, 0, prompt, 1, params, 0)])[0]
    q = dict(zip(plain.draft_probs[0].token_ids, plain.draft_probs[0].probs))
    hint = max(q, key=q.get)  # the likeliest token: kept often, rejected often enough too
    vocab = engine.vocab_size
    counts, kept = np.zeros(vocab), 0
    samples = 1500
    results = []
    for start in range(0, samples, 32):  # 32 seeds' calls in one batched forward, each its own generator
        seeds = range(start, min(start + 32, samples))
        results += proposer_.propose_batch([proposer_.call(f"s{seed}", 0, 0, prompt, 1, params, seed, hints=[hint])
                                            for seed in seeds])
        for seed in seeds:
            engine.release(f"s{seed}")
    for result in results:
        assert dict(zip(result.draft_probs[0].token_ids, result.draft_probs[0].probs)) == pytest.approx(q)
        counts[result.draft_tokens[0]] += 1
        kept += result.hints_kept
        assert result.hints_kept == (result.draft_tokens[0] == hint)
        assert len(result.draft_tokens) == 1 + result.hints_kept
    expected = np.array([q.get(t, 0.0) for t in range(vocab)]) * samples
    assert counts[expected == 0].sum() == 0
    assert chi2_pvalue(counts[expected > 0], expected[expected > 0]) > 1e-3
    assert 0 < kept < samples


@pytest.mark.e2e
def test_auto_with_hints_is_greedy_exact(small_vocab_models):
    """On 12 words greedy output soon cycles, so prompt lookup has hints for the draft rounds;
    the target drafts for itself, so the draft agrees with the hints the target will accept."""
    target = draft = small_vocab_models["target"]
    hints = 0
    with Cluster(draft, target, coordinator={"default_num_speculative_tokens": 1}) as cluster:
        for ids in IDS_PROMPTS:
            expected = target_only(target, ids, 48)
            response = cluster.complete(token_ids=ids, max_new_tokens=48, ignore_eos=True,
                                        proposer=proposer("auto"))
            assert list(response.token_ids) == expected
            stats = response.stats
            assert stats.draft_hint_accepted_tokens <= stats.draft_hint_tokens <= stats.draft_tokens
            hints += stats.draft_hint_tokens
    assert hints > 0
