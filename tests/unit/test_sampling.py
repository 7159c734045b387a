"""Pure-function tests of the sampling warp and the acceptance step, on hand-built logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.maths.acceptance import accept_greedy, accept_sampled
from specdec.maths.draft_q import DraftQ
from specdec.errors import InvalidArgument
from specdec.rng import RequestRng
from specdec.runtime.generators import make_generator
from specdec.maths.sampling import proposal_top_k, target_probs, truncate_top_k, warp_logits
from specdec.types import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])  # [1, vocab=6]


def test_temperature_zero_is_one_hot_argmax():
    probs = target_probs(LOGITS, SamplingParams(temperature=0.0))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_k_most_likely():
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all()
    expected = torch.softmax(torch.tensor([2.0, 1.0]), dim=0)
    assert torch.allclose(probs[0, :2], expected)


def test_top_p_keeps_smallest_set_reaching_p():
    full = torch.softmax(LOGITS[0], dim=0)
    # the first two tokens hold < 0.9 of the mass, the first three >= 0.9? pick p between cumsums
    cumsum = torch.cumsum(full, 0)
    top_p = float((cumsum[1] + cumsum[2]) / 2)  # needs exactly three tokens
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert (probs[0, :3] > 0).all() and (probs[0, 3:] == 0).all()
    assert torch.allclose(probs[0, :3], full[:3] / full[:3].sum())


def test_warp_temperature_scales_logits():
    warped = warp_logits(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(warped, LOGITS * 2)


@pytest.mark.parametrize("temperature, top_p, kept", [
    (0.25, 0.75, [0]),  # sharpened first: token 0 alone holds 0.87 >= 0.75 (at T=1 it holds 0.5)
    (4.0, 0.45, [0, 1]),  # flattened first: token 0 holds 0.37 < 0.45 (at T=1 it holds 0.5)
])
def test_temperature_applies_before_top_p(temperature, top_p, kept):
    """The kept set depends on the order; the warp is temperature, then top-k, then top-p."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))  # [1, vocab=3]
    probs = target_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))[0]
    assert (probs > 0).nonzero().flatten().tolist() == kept
    expected = torch.softmax(logits[0, kept] / temperature, dim=0)
    assert torch.allclose(probs[kept], expected)


def densify(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sparse rows back to dense (how a test compares a truncated q with p). ids/probs [n, k] -> [n, vocab]; ids >= vocab are dropped."""
    dense = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.float32, device=probs.device)
    ids = ids.clamp(max=vocab).masked_fill(ids < 0, vocab)  # out-of-range ids land in a spill column
    dense.scatter_add_(1, ids, probs.float())
    return dense[:, :vocab]


def test_truncate_top_k_and_densify_round_trip():
    probs = torch.softmax(LOGITS, dim=-1)
    ids, kept = truncate_top_k(probs, 3)
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.allclose(kept.sum(), torch.tensor(1.0))
    dense = densify(ids, kept, 6)
    assert torch.allclose(dense[0, :3], probs[0, :3] / probs[0, :3].sum())
    assert (dense[0, 3:] == 0).all()
    # ids beyond the (target) vocabulary are dropped, not wrapped
    assert densify(torch.tensor([[7, 1]]), torch.tensor([[0.5, 0.5]]), 6).tolist() == [[0, 0.5, 0, 0, 0, 0]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(top_k=5), SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=50, top_p=0.5), SamplingParams(temperature=0.5, top_k=3, top_p=0.99),
    SamplingParams(top_p=0.05), SamplingParams(top_k=40),
])
@pytest.mark.parametrize("vocab, k", [(12, 4), (384, 32), (5000, 32)])
def test_draft_proposal_equals_the_warp_truncated_to_top_k(params, vocab, k):
    """The draft's q without a sort of the vocabulary is the warped distribution cut to its top k."""
    logits = torch.randn((6, vocab), generator=torch.Generator().manual_seed(vocab + k)) * 3
    want_ids, want = truncate_top_k(target_probs(logits, params), k)
    ids, probs = proposal_top_k(logits, params, k)
    assert ids.shape == want_ids.shape
    for row in range(6):
        expected = {i: p for i, p in zip(want_ids[row].tolist(), want[row].tolist()) if p > 0}
        got = {i: p for i, p in zip(ids[row].tolist(), probs[row].tolist()) if p > 0}
        assert got.keys() == expected.keys()
        assert max(abs(got[i] - expected[i]) for i in got) < 1e-6
        assert probs[row].tolist() == sorted(probs[row].tolist(), reverse=True)  # most likely first


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=-0.1), SamplingParams(top_k=-1), SamplingParams(top_p=0.0),
     SamplingParams(top_p=1.5), SamplingParams(temperature=float("nan"))],
)
def test_invalid_params_rejected(params):
    with pytest.raises(InvalidArgument):
        params.validate()


# ---- greedy acceptance ----------------------------------------------------------------------

def test_greedy_perfect_match_gives_bonus():
    verdict = accept_greedy([3, 1, 4], [3, 1, 4, 9])
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (3, 9, True)
    assert verdict.committed([3, 1, 4]) == [3, 1, 4, 9]


def test_greedy_early_mismatch_gives_correction():
    verdict = accept_greedy([3, 1, 4], [3, 2, 4, 9])
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (1, 2, False)
    assert verdict.committed([3, 1, 4]) == [3, 2]


def test_greedy_no_drafts_is_plain_decoding():
    verdict = accept_greedy([], [5])
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (0, 5, True)


# ---- stochastic acceptance -------------------------------------------------------------------

def _one_hot(ids, vocab):
    out = torch.zeros(len(ids), vocab)
    out[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    return out


def test_sampled_perfect_match_accepts_all_and_samples_bonus():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # [γ+1, vocab]
    q = _one_hot([1, 2], 3)
    verdict = accept_sampled([1, 2], DraftQ.from_dense(q, [1, 2]), p, make_generator(0))
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (2, 0, True)
    assert verdict.accept_probs == [1.0, 1.0]


def test_sampled_early_mismatch_recovers_from_residual():
    # target never produces token 0; draft proposed it -> rejected, recovered from max(0, p - q)
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.8, 0.2, 0.0]])
    for seed in range(20):
        verdict = accept_sampled([0], DraftQ.from_dense(q, [0]), p, make_generator(seed))
        assert verdict.num_accepted == 0 and not verdict.is_bonus
        # residual = [0, 0.3, 0.5] -> never token 0
        assert verdict.next_token in (1, 2)
        assert verdict.accept_probs == [0.0]


def test_sampled_no_drafts_samples_from_p():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    verdict = accept_sampled([], DraftQ.from_dense(p[:0], []), p, make_generator(1))
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (0, 2, True)


def test_q_with_zeros_off_the_sampled_token_is_fine():
    # a top-K truncated q: zeros everywhere but the kept tokens
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    verdict = accept_sampled([1], DraftQ.from_dense(q, [1]), p, make_generator(3))
    assert verdict.accept_probs == [0.25]


def test_q_zero_on_the_drafted_token_is_rejected():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(InvalidArgument):
        accept_sampled([0], DraftQ.from_dense(torch.tensor([[0.0, 1.0]]), [0]), p, make_generator(0))


def test_seeded_determinism():
    p = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(5)), dim=-1)
    q = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(6)), dim=-1)
    drafts = [int(q[i].argmax()) for i in range(3)]
    runs = [accept_sampled(drafts, DraftQ.from_dense(q, drafts), p, make_generator(42)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    others = {accept_sampled(drafts, DraftQ.from_dense(q, drafts), p, make_generator(s)).committed(drafts).__repr__() for s in range(40)}
    assert len(others) > 1  # different seeds do give different outcomes
    rng_a, rng_b = RequestRng(7), RequestRng(7)
    assert [rng_a.next_seed() for _ in range(5)] == [rng_b.next_seed() for _ in range(5)]


def chi2_pvalue(observed, probs) -> float:
    """Chi-square goodness of fit of counts against a distribution (float64, renormalised)."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if len(observed) < 2:
        raise ValueError("a chi-square test needs at least two cells")
    return float(chisquare(observed, probs / probs.sum() * observed.sum()).pvalue)


def _emitted_distribution(p_rows, q_rows, draws, gamma, seed=0):
    """Counts of (first emitted token) and (second emitted token) over `draws` rounds. The drafts
    of all rounds are drawn from q at once (each position independently, as the draft draws
    them), and each distinct tuple's DraftQ built once: the rounds' verification, the code under
    test, still runs one round at a time."""
    vocab = p_rows.shape[1]
    generator = make_generator(seed)
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    drawn = torch.stack([torch.multinomial(q_rows[i], draws, replacement=True, generator=generator)
                         for i in range(gamma)], dim=1).tolist()  # [draws, γ]
    draft_qs: dict[tuple[int, ...], DraftQ] = {}
    for drafts in drawn:
        key = tuple(drafts)
        if key not in draft_qs:
            draft_qs[key] = DraftQ.from_dense(q_rows[:gamma], drafts)
        verdict = accept_sampled(drafts, draft_qs[key], p_rows[: gamma + 1], generator)
        tokens = verdict.committed(drafts)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=0.9, top_p=0.8),
])
def test_distribution_converges_to_target(params):
    """Whatever q is, the emitted tokens follow the (warped) target distribution."""
    gen = torch.Generator().manual_seed(123)
    target_logits = torch.randn(3, 6, generator=gen) * 1.5  # [γ+1, vocab]
    draft_logits = torch.randn(2, 6, generator=gen) * 1.5  # [γ, vocab], q != p
    p = target_probs(target_logits, params)
    ids, kept = truncate_top_k(torch.softmax(draft_logits, dim=-1), 4)  # truncated like the draft service
    q = densify(ids, kept, 6)
    draws = 20_000
    first, second = _emitted_distribution(p, q, draws, gamma=2)
    support = p[0] > 0
    assert chi2_pvalue(first[support.numpy()], p[0][support].numpy()) > 1e-3, (first, p[0] * draws)
    assert first[(~support).numpy()].sum() == 0
    # given the first token was an accepted draft, the second follows p[1]
    n_second = second.sum()
    assert n_second > 1000
    support1 = p[1] > 0
    assert chi2_pvalue(second[support1.numpy()], p[1][support1].numpy()) > 1e-3, (second, p[1] * n_second)


def test_distribution_test_can_fail():
    """The same statistic flags a sampler that ignores the residual (returns a draft of q)."""
    gen = torch.Generator().manual_seed(123)
    p = torch.softmax(torch.randn(2, 6, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(1, 6, generator=gen) * 1.5, dim=-1)
    generator = make_generator(0)
    counts = np.zeros(6)
    for _ in range(5000):
        counts[int(torch.multinomial(q[0], 1, generator=generator))] += 1  # "always accept"
    assert chi2_pvalue(counts, p[0].numpy()) < 1e-6


# ---- one-hot proposals (prompt lookup) -------------------------------------------------------

@pytest.mark.parametrize("params, drafts", [
    (SamplingParams(temperature=1.0), [4, 5]),            # likely drafts
    (SamplingParams(temperature=0.7, top_k=3), [5, 0]),   # a first draft outside the top-k
    (SamplingParams(temperature=0.9, top_p=0.8), [0, 1]),  # an unlikely first draft
], ids=["t1", "t0.7-topk3", "t0.9-topp0.8"])
def test_one_hot_proposals_keep_the_target_distribution(params, drafts):
    """Deterministic drafts (q one-hot): accept d with probability p(d), else recover from p with
    d removed — the emitted tokens follow p whatever the drafts are."""
    gen = torch.Generator().manual_seed(321)
    p = target_probs(torch.randn(3, 6, generator=gen) * 0.7, params)  # [γ+1, vocab]
    q = _one_hot(drafts, 6)  # [γ, vocab]
    draws = 20_000
    first, second = _emitted_distribution(p, q, draws, gamma=2, seed=4)
    support = (p[0] > 0).numpy()
    assert first[~support].sum() == 0
    assert chi2_pvalue(first[support], p[0].numpy()[support]) > 1e-3, (first, p[0] * draws)
    # the second token is emitted after an accepted first draft (probability p(d1))
    assert second.sum() == first[drafts[0]]
    support1 = (p[1] > 0).numpy()
    assert second[~support1].sum() == 0
    if second.sum() > 1000 and support1.sum() > 1:
        assert chi2_pvalue(second[support1], p[1].numpy()[support1]) > 1e-3, (second, p[1] * second.sum())


def test_one_hot_draft_accept_probability_is_p_of_the_draft():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    verdict = accept_sampled([1], DraftQ.from_dense(_one_hot([1], 3), [1]), p, make_generator(0))
    assert verdict.accept_probs == [pytest.approx(0.6)]
    rejected = [accept_sampled([1], DraftQ.from_dense(_one_hot([1], 3), [1]), p, make_generator(s))
                for s in range(200)]
    recovered = [v.next_token for v in rejected if v.num_accepted == 0]
    assert recovered and 1 not in recovered  # recovered from p with the draft removed


def _nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference top-p: sort the whole vocabulary."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    return ~drop_sorted.scatter(-1, order, drop_sorted)


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.01], ids=["peaked", "spread", "flat"])
@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.999])
def test_top_p_without_a_full_sort_keeps_the_same_tokens(scale, top_p):
    """Peaked rows keep a few tokens (found in the top 64); flat rows need most of the 5,000
    tokens, past the first k, so the ranking widens — the same set as a full sort either way."""
    from specdec.maths.sampling import _nucleus

    generator = torch.Generator().manual_seed(int(scale * 100) + int(top_p * 1000))
    logits = torch.randn(6, 5000, generator=generator, dtype=torch.float64).float() * scale
    assert torch.equal(_nucleus(logits, top_p), _nucleus_by_full_sort(logits, top_p))
