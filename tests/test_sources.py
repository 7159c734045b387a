"""Proposal sources and adaptive γ end to end: greedy output equals target-only output with
every source a request may name (its `proposer`: auto, draft, ngram = prompt lookup, none),
fixed or adaptive γ; γ rises to the limit with a draft that is always right and falls to 0
with one that is always wrong; the per-request overrides.

Tiny random models, float64, real gRPC servers on loopback.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec_cli import tiny
from specdec.runtime.loader import load_model
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.spies import RequestRecorder
from tests.test_e2e_greedy import reference

pytestmark = pytest.mark.e2e

PROPOSERS = ("auto", "draft", "ngram", "none")
# prompts that repeat themselves, so prompt lookup finds matches from the first round on
TEXT_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
    "the cat sat on the mat. the cat sat on the mat. the cat sat",
]
IDS_PROMPTS = [[3, 7, 5, 3, 7, 5, 3, 7], [1, 2, 9, 4, 1, 2, 9]]  # the 12-word vocabulary
NEW_TOKENS = 40


def proposer(name: str) -> int:
    return coordinator_pb2.Proposer.Value(f"PROPOSER_{name.upper()}")


def target_only(target_dir: str, history: list[int], new_tokens: int) -> list[int]:
    """The target alone, greedy, from token ids (EOS ignored)."""
    model = load_model(target_dir, "float64").model
    out = model.generate(torch.tensor([history]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(history):].tolist()


def check_sources(name: str, stats, gammas_fixed: int | None = None, fresh: bool = True) -> None:
    """The stats say which sources ran, consistently with the proposer asked for. `fresh`: the
    coordinator has no acceptance data yet, so the allowed sources get warm-up rounds (later
    sessions start from the acceptance measured so far and may skip a source that never pays)."""
    assert stats.rounds == len(stats.gamma_per_round) == sum(stats.rounds_by_gamma)
    assert stats.draft_tokens == sum(stats.gamma_per_round)
    assert stats.rounds == stats.draft_rounds + stats.ngram_rounds + stats.rounds_by_gamma[0]
    assert stats.cache_misses == 0  # what each service holds was tracked right
    if name == "none":
        assert stats.draft_tokens == 0 and stats.rounds == stats.generated_tokens
    if name in ("none", "ngram"):
        assert stats.draft_rounds == 0
        assert stats.draft_prefill_tokens == 0  # no Propose call at all
    if name in ("none", "draft"):
        assert stats.ngram_rounds == 0 and stats.ngram_draft_tokens == 0
    overridden = gammas_fixed is not None and name != "auto"  # a fixed γ for one source: it runs
    if name in ("auto", "ngram") and (fresh or overridden):
        assert stats.ngram_rounds > 0  # the prompts repeat: lookup found matches
    if name in ("auto", "draft") and (fresh or overridden):
        assert stats.draft_rounds > 0
    if gammas_fixed is not None and name != "none":
        assert max(stats.gamma_per_round) <= gammas_fixed


@pytest.mark.parametrize("gamma", [None, 3], ids=["adaptive", "fixed3"])
def test_greedy_equals_target_only_with_every_proposer(models, gamma):
    paths = models["llama"]
    expected = reference(paths["target"], TEXT_PROMPTS, NEW_TOKENS)
    for name in PROPOSERS:
        with Cluster(paths["draft"], paths["target"]) as cluster:  # fresh acceptance estimates
            for prompt in TEXT_PROMPTS:
                fields = {} if gamma is None else {"num_speculative_tokens": gamma}
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            proposer=proposer(name), **fields)
                assert list(response.token_ids) == expected[prompt], (name, gamma, prompt)
                assert response.stats.generated_tokens == NEW_TOKENS
                check_sources(name, response.stats, gamma, fresh=prompt == TEXT_PROMPTS[0])


def test_greedy_exact_with_accepted_lookups_on_the_small_vocabulary(small_vocab_models):
    """On 12 words greedy output soon cycles, so prompt lookup proposes what the target says."""
    target, draft = small_vocab_models["target"], small_vocab_models["draft"]
    expected = {tuple(ids): target_only(target, ids, 64) for ids in IDS_PROMPTS}
    for name in PROPOSERS:
        with Cluster(draft, target) as cluster:  # fresh acceptance estimates
            for ids in IDS_PROMPTS:
                response = cluster.complete(token_ids=ids, max_new_tokens=64, ignore_eos=True,
                                            proposer=proposer(name))
                assert list(response.token_ids) == expected[tuple(ids)], (name, ids)
                check_sources(name, response.stats, fresh=ids == IDS_PROMPTS[0])
                if name == "ngram":
                    assert response.stats.ngram_accepted_tokens > 0
                    assert response.stats.tokens_per_round > 1.0


def test_the_draft_catches_up_after_rounds_that_skipped_it(small_vocab_models):
    """A session continued with the draft, then prompt lookup only, then the draft again: the
    draft is sent exactly what it lacks (no cache miss) and the output stays exact."""
    target, draft = small_vocab_models["target"], small_vocab_models["draft"]
    ids = IDS_PROMPTS[0]
    with Cluster(draft, target) as cluster:
        first = cluster.complete(token_ids=ids, max_new_tokens=10, ignore_eos=True, proposer=proposer("draft"),
                                 num_speculative_tokens=3)
        sid = first.session_id
        second = cluster.complete(session_id=sid, token_ids=[4], max_new_tokens=20, ignore_eos=True,
                                  proposer=proposer("ngram"))
        assert second.stats.draft_prefill_tokens == 0 and second.stats.ngram_rounds > 0
        third = cluster.complete(session_id=sid, token_ids=[6], max_new_tokens=12, ignore_eos=True,
                                 proposer=proposer("draft"), num_speculative_tokens=3)
        history = ids + list(first.token_ids) + [4] + list(second.token_ids) + [6]
        assert list(third.token_ids) == target_only(target, history, 12)
        assert list(second.token_ids) == target_only(target, ids + list(first.token_ids) + [4], 20)
        assert third.stats.cache_misses == 0
        # the draft's first call carries the tokens committed while it was skipped, and no more
        # than the session's whole history (it kept its cache of the first request)
        assert len(second.token_ids) + 1 < third.stats.draft_prefill_tokens < len(history)


def test_draft_always_right_gamma_rises_to_the_limit(small_vocab_models):
    """The draft is the target itself: every proposal is accepted, so after the warm-up rounds
    adaptive γ is the limit (or what the request has left)."""
    target = small_vocab_models["target"]
    limit = 6
    # the 12-word model is rarely sure of a token: without the early stop, γ is what the policy asks
    coordinator = {"max_num_speculative_tokens": limit, "draft_cost_ratio": 0.1, "draft_min_confidence": 0.0}
    with Cluster(target, target, coordinator=coordinator) as cluster:
        response = cluster.complete(token_ids=IDS_PROMPTS[1], max_new_tokens=60, ignore_eos=True,
                                    proposer=proposer("draft"))
        assert list(response.token_ids) == target_only(target, IDS_PROMPTS[1], 60)
        stats = response.stats
        assert stats.acceptance_rate == 1.0
        gammas = list(stats.gamma_per_round)
        assert gammas[:2] == [4, 4]  # warm-up at --default-num-speculative-tokens
        left = 60 - 10
        for gamma in gammas[2:]:
            assert gamma == min(limit, left - 1)
            left -= gamma + 1
        assert gammas[2] == limit and stats.rounds_by_gamma[limit] >= 5


def always_wrong_draft(root, tokenizer) -> str:
    """A draft whose logits are all zero: it always proposes token 0."""
    from transformers import AutoModelForCausalLM

    path = tiny.build_model(root, tokenizer, "llama", seed=5, layers=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("cost_ratio", [0.0, 0.1], ids=["measured", "fixed"])
def test_draft_always_wrong_gamma_falls_to_zero(small_vocab_models, tmp_path, cost_ratio):
    target = small_vocab_models["target"]
    draft = always_wrong_draft(tmp_path / "wrong", tiny.word_tokenizer(12))
    ids, n = [5, 5, 5], 64
    expected = target_only(target, ids, n)
    assert 0 not in expected  # so every proposal (token 0) is rejected
    # (its uniform q would stop every draft round after one token: keep the policy's γ visible)
    with Cluster(draft, target, coordinator={"draft_cost_ratio": cost_ratio, "draft_min_confidence": 0.0}) as cluster:
        response = cluster.complete(token_ids=ids, max_new_tokens=n, ignore_eos=True, proposer=proposer("draft"))
        assert list(response.token_ids) == expected
        stats = response.stats
        assert stats.accepted_tokens == 0 and stats.rounds == n
        gammas = list(stats.gamma_per_round)
        assert gammas[:2] == [4, 4]  # warm-up
        # then plain decoding, but for rare probes (every 16 rounds, then 32, ...)
        probes = [i for i, g in enumerate(gammas[2:], start=2) if g > 0]
        assert len(probes) <= 2 and all(gammas[i] <= 2 for i in probes)
        assert gammas[-10:] == [0] * 10
        assert stats.draft_rounds == 2 + len(probes)


def test_fixed_gamma_and_proposer_overrides(small_vocab_models):
    target, draft = small_vocab_models["target"], small_vocab_models["draft"]
    ids = IDS_PROMPTS[0]
    expected = target_only(target, ids, 30)
    with Cluster(draft, target) as cluster:
        fixed = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True, proposer=proposer("draft"),
                                 num_speculative_tokens=5)
        assert list(fixed.token_ids) == expected
        gammas = list(fixed.stats.gamma_per_round)
        # γ = 5 in every round but those where fewer than 6 tokens were left (at most 5 rounds)
        assert gammas[0] == 5 and max(gammas) == 5 and sum(g < 5 for g in gammas) <= 5
        # only a round with a single token left proposes nothing
        assert fixed.stats.draft_rounds == fixed.stats.rounds - fixed.stats.rounds_by_gamma[0]
        assert fixed.stats.rounds_by_gamma[0] <= 1
        zero = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True, proposer=proposer("auto"),
                                num_speculative_tokens=0)
        assert list(zero.token_ids) == expected and zero.stats.draft_tokens == 0 and zero.stats.rounds == 30
        # ngram with a fixed γ: never more than γ, never the draft
        lookup = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True, proposer=proposer("ngram"),
                                  num_speculative_tokens=2)
        assert list(lookup.token_ids) == expected
        assert set(lookup.stats.gamma_per_round) <= {0, 1, 2} and lookup.stats.ngram_rounds > 0
        assert lookup.stats.draft_rounds == 0 and lookup.stats.draft_prefill_tokens == 0
    # the coordinator's default proposer applies when the request leaves it unset
    with Cluster(draft, target, coordinator={"default_proposer": "none"}) as cluster:
        plain = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True)
        assert list(plain.token_ids) == expected and plain.stats.draft_tokens == 0
        asked = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True, proposer=proposer("draft"),
                                 num_speculative_tokens=3)
        assert list(asked.token_ids) == expected and asked.stats.draft_rounds > 0


def test_unknown_proposer_is_invalid_argument(llama_cluster):
    with pytest.raises(grpc.RpcError) as info:
        llama_cluster.complete(prompt="hi", max_new_tokens=2, proposer=9)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "proposer must be one of auto, draft, ngram, none" in info.value.details()


def test_a_skipped_draft_still_gets_the_prompt_in_the_first_round(small_vocab_models, tmp_path):
    """Once the coordinator has learnt that the draft never pays, auto starts a request without
    it, but sends it the prompt alongside the first verification, so a later probe of the draft
    only catches up on the tokens generated since."""
    target = small_vocab_models["target"]
    draft = always_wrong_draft(tmp_path / "wrong", tiny.word_tokenizer(12))
    ids = [5, 5, 5]
    # both services run in this process: on the same cores, where nothing is sent alongside
    # unless the coordinator is told otherwise
    with Cluster(draft, target, coordinator={"draft_cost_ratio": 0.1, "tiers_share_cores": "no"}) as cluster:
        learnt = cluster.complete(token_ids=ids, max_new_tokens=8, ignore_eos=True, proposer=proposer("draft"))
        assert learnt.stats.accepted_tokens == 0 and learnt.stats.draft_rounds == 2  # the warm-up
        response = cluster.complete(token_ids=ids, max_new_tokens=96, ignore_eos=True, proposer=proposer("auto"))
        assert list(response.token_ids) == target_only(target, ids, 96)
        stats = response.stats
        # the first round was prompt lookup's warm-up, yet the draft got the prompt then: without
        # that, its first call (a probe) would have carried the tokens generated before it too
        assert stats.ngram_rounds > 0 and stats.draft_rounds > 0
        assert stats.draft_prefill_tokens == len(ids)
        assert stats.cache_misses == 0


def test_tiers_on_the_same_cores_send_no_prompt_alongside(small_vocab_models, tmp_path):
    """Where the draft and the target report the same cores (here: one process), the draft's
    prefill would slow the verification it runs beside: the first round sends it nothing, and
    a later probe of the draft catches up on the prompt and what was generated since."""
    target = small_vocab_models["target"]
    draft = always_wrong_draft(tmp_path / "wrong", tiny.word_tokenizer(12))
    ids = [5, 5, 5]
    recorder = RequestRecorder("Propose")
    with Cluster(draft, target, coordinator={"draft_cost_ratio": 0.1}, interceptors=[recorder]) as cluster:
        assert not cluster.coordinator.round_loop.draft_model.beside_verification
        cluster.complete(token_ids=ids, max_new_tokens=8, ignore_eos=True, proposer=proposer("draft"))
        recorder.calls.clear()
        response = cluster.complete(token_ids=ids, max_new_tokens=96, ignore_eos=True, proposer=proposer("auto"))
        assert list(response.token_ids) == target_only(target, ids, 96)
        stats = response.stats
        assert stats.ngram_rounds > 0 and stats.cache_misses == 0
        # the draft's first call, if the policy probed it, came after generated tokens: it was
        # not sent the prompt alone alongside the first round
        if recorder.calls:
            first = recorder.calls[0][1]
            assert first.prefix_len == 0 and len(first.new_tokens) > len(ids)
        assert stats.draft_prefill_tokens != len(ids)
