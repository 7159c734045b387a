"""The draft stops early where it is unsure (`min_confidence`).

Pure proposer on the small-vocabulary draft (float64): greedy, the call stops right after the
first token whose softmax probability under the draft, computed here from the model itself, is
below the threshold, and its tokens are the prefix of the full-γ call; sampled, every token but
the last had q ≥ threshold and the last had q below it (or γ was reached), and the draws keep
their distribution (chi-square of the second token, which only exists when the first was sure);
the cache then holds the call's tokens but the last, as after any call. A bad threshold is
INVALID_ARGUMENT over gRPC. End to end: greedy output equals the target's with early stops
happening, and a fixed γ is never cut.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from specdec.config import DraftConfig
from specdec.runtime.loader import load_model
from specdec.runtime.engines import engine_from_config
from specdec.types import SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.runtime.drafting import HostDrafting
from tests.cluster import Cluster
from tests.test_draft_hints import GREEDY, PROMPT
from tests.test_sources import IDS_PROMPTS, proposer, target_only
from tests.test_sampling import chi2_pvalue

GAMMA = 8
BATCH = 16  # seeds whose calls (one with the threshold, one without) share a batched forward


def greedy_confidences(model_dir: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """The draft's softmax probability of each of `tokens` (its greedy continuation of
    `prompt`), from one forward of the model outside the service."""
    model = load_model(model_dir, "float64").model
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]  # [len, vocab]
    probs = torch.softmax(logits[len(prompt) - 1:-1], dim=-1)  # [len(tokens), vocab]
    assert probs.argmax(dim=-1).tolist() == tokens  # they are its greedy tokens
    return probs.max(dim=-1).values.tolist()


@pytest.fixture(scope="module")
def draft(small_vocab_models):
    engine = engine_from_config(DraftConfig(model=small_vocab_models["draft"], dtype="float64"))
    return HostDrafting(engine, 32)


@pytest.mark.unit
def test_greedy_stops_right_after_the_first_unsure_token(draft, small_vocab_models):
    greedy = SamplingParams(temperature=0.0)
    stops = set()
    for n, prompt in enumerate(IDS_PROMPTS + [[4, 4, 8, 2], [11, 0, 6]]):
        full = draft.propose_batch([draft.call(f"full{n}", 0, 0, prompt, GAMMA, greedy, 0)])[0]
        confidences = greedy_confidences(small_vocab_models["draft"], prompt, full.draft_tokens)
        levels = sorted(set(confidences))
        for threshold in [(a + b) / 2 for a, b in zip(levels, levels[1:])][:3]:  # some fall below, some not
            session = f"cut{n}-{threshold}"
            cut = draft.propose_batch([draft.call(session, 0, 0, prompt, GAMMA, greedy, 0,
                                                  min_confidence=threshold)])[0]
            first_unsure = next(i for i, c in enumerate(confidences) if c < threshold)
            assert cut.draft_tokens == full.draft_tokens[:first_unsure + 1]
            assert cut.cached_len == len(prompt) + len(cut.draft_tokens) - 1
            stops.add(len(cut.draft_tokens))
            draft.release(session)
        draft.release(f"full{n}")
    assert len(stops) > 1  # the stop moved with the threshold


@pytest.mark.unit
def test_calls_in_one_batch_stop_each_on_their_own(draft):
    """A batch of calls: one stops at its first token, the others run their γ."""
    greedy = SamplingParams(temperature=0.0)
    calls = [draft.call("sure", 0, 0, IDS_PROMPTS[0], 5, greedy, 0),
             draft.call("unsure", 0, 0, IDS_PROMPTS[0], 5, greedy, 0, min_confidence=0.999999),
             draft.call("other", 0, 0, IDS_PROMPTS[1], 3, greedy, 0)]
    sure, unsure, other = draft.propose_batch(calls)
    assert len(sure.draft_tokens) == 5 and len(other.draft_tokens) == 3
    assert unsure.draft_tokens == sure.draft_tokens[:1] and unsure.cached_len == len(IDS_PROMPTS[0])
    for name in ("sure", "unsure", "other"):
        draft.release(name)


@pytest.mark.service
def test_sampled_stops_after_a_draw_below_the_threshold_and_keeps_q(draft):
    params, threshold, samples = SamplingParams(temperature=1.0), 0.2, 1200
    prompt = [3, 7, 5, 3]
    q1 = draft.propose_batch([draft.call("q1", 0, 0, prompt, 1, params, 0)])[0].draft_probs[0]
    first = q1.token_ids[int(np.argmax(q1.probs))]
    assert max(q1.probs) >= threshold  # a draw of `first` continues: the second token is drawn
    counts = np.zeros(draft.engine.vocab_size)
    q2: dict[int, float] | None = None
    lengths = set()
    pairs = []  # (the call with the threshold's result, the full call's): BATCH seeds per batched forward
    for start in range(0, samples, BATCH):
        seeds = range(start, min(start + BATCH, samples))
        calls = [call for seed in seeds for call in (
            draft.call(f"s{seed}", 0, 0, prompt, 4, params, seed, min_confidence=threshold),
            draft.call(f"f{seed}", 0, 0, prompt, 4, params, seed))]
        results = draft.propose_batch(calls)
        pairs += zip(results[::2], results[1::2])
        for seed in seeds:
            draft.release(f"s{seed}")
            draft.release(f"f{seed}")
    for result, reference in pairs:
        sure = [dict(zip(d.token_ids, d.probs))[t] for t, d in zip(result.draft_tokens, result.draft_probs)]
        assert all(p >= threshold for p in sure[:-1])
        assert sure[-1] < threshold or len(result.draft_tokens) == 4
        # the same seed draws the same tokens: the early stop only truncates
        assert result.draft_tokens == reference.draft_tokens[:len(result.draft_tokens)]
        assert result.cached_len == len(prompt) + len(result.draft_tokens) - 1
        lengths.add(len(result.draft_tokens))
        if result.draft_tokens[0] == first:  # given the first token, the second's q is fixed
            dist = dict(zip(result.draft_probs[1].token_ids, result.draft_probs[1].probs))
            q2 = q2 or dist
            assert dist == pytest.approx(q2)
            counts[result.draft_tokens[1]] += 1
    assert len(lengths) > 1
    assert q2 is not None and counts.sum() > 100
    expected = np.array([q2.get(t, 0.0) for t in range(len(counts))]) * counts.sum()
    assert counts[expected == 0].sum() == 0
    assert chi2_pvalue(counts[expected > 0], expected[expected > 0]) > 1e-3


@pytest.mark.e2e
def test_bad_min_confidence_is_invalid_argument(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        for bad in (1.0, -0.1, float("nan")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Propose(draft_pb2.ProposeRequest(session_id="bad", new_tokens=PROMPT, num_speculative_tokens=2,
                                                      sampling=GREEDY, min_confidence=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "min_confidence" in err.value.details()


@pytest.mark.e2e
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
