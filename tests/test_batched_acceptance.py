"""The batched, on-device acceptance step (specdec/maths/batched_acceptance.py) against the
reference it implements (specdec/maths/acceptance.py): given the same uniforms, every row of
random p, q, drafts, γ and seeds decides exactly what the reference decides (the drafts
accepted, the next token, the ratios), greedy and sampled rows in one batch; sampled output
follows p (chi-square over many rows decided in one call, chains of different γ padded
together), the residual is drawn at a rejection, and a row's draws are its own generator's alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.maths import acceptance
from specdec.maths.acceptance import accept_greedy, accept_sampled
from specdec.maths.batched_acceptance import ChainBatch, decide, inverse_cdf, row_uniforms
from specdec.maths.draft_q import DraftQ
from specdec.runtime.generators import make_generator
from specdec.types import SparseDist
from tests.test_sampling import chi2_pvalue

pytestmark = pytest.mark.unit

VOCAB = 10


def dists(rows: int, seed: int, sharp: float = 2.0) -> torch.Tensor:
    """[rows, VOCAB] random distributions, some entries exactly zero."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * sharp
    probs = torch.softmax(logits, dim=-1)
    probs[:, 0] = 0.0  # a token outside the support
    return probs / probs.sum(-1, keepdim=True)


def batch(p: torch.Tensor, drafts: list[list[int]], q: torch.Tensor, greedy: list[bool],
          uniforms: torch.Tensor) -> ChainBatch:
    """p [R, G+1, V]; q [R, G, V] dense (made sparse here: every id, padded rows zero)."""
    rows, gamma_max = len(drafts), p.shape[1] - 1
    padded = torch.zeros((rows, gamma_max), dtype=torch.long)
    for r, row in enumerate(drafts):
        padded[r, :len(row)] = torch.tensor(row, dtype=torch.long)
    ids = torch.arange(VOCAB).expand(rows, gamma_max, VOCAB).contiguous()
    return ChainBatch(p.float(), padded, torch.tensor([len(d) for d in drafts]), ids, q.float(),
                      torch.tensor(greedy), uniforms)


class GivenUniforms:
    """torch for the reference rule, with its draws replaced by given uniforms, in order: `rand`
    hands out the next ones, `draw` (for `sample`) takes the next by the inverse CDF, as the
    batched form draws. The reference then decides with exactly the uniforms the batched form
    was given, so the two must agree row by row, not only in distribution."""

    def __init__(self, values: list[float]):
        self.values = list(values)

    def take(self, n: int) -> list[float]:
        taken, self.values[:n] = self.values[:n], []
        assert len(taken) == n, "the reference drew more uniforms than the batched form has"
        return taken

    def rand(self, n: int, generator=None, device=None) -> torch.Tensor:
        return torch.tensor(self.take(n), dtype=torch.float32, device=device)

    def draw(self, probs: torch.Tensor, generator=None) -> int:
        return int(inverse_cdf(probs[None], torch.tensor(self.take(1)))[0])

    def __getattr__(self, name):
        return getattr(torch, name)


def test_each_row_decides_as_the_reference_with_the_same_uniforms(monkeypatch):
    """Random p, q, γ (0 included), drafts and seeds, a quarter of the rows greedy: each row of
    one batch decides what accept_sampled / accept_greedy decide with that row's uniforms."""
    rows, gamma_max = 400, 6
    g = torch.Generator().manual_seed(21)
    p = dists(rows * (gamma_max + 1), 22).reshape(rows, gamma_max + 1, VOCAB)  # [R, G+1, V]
    q = dists(rows * gamma_max, 23, sharp=1.0).reshape(rows, gamma_max, VOCAB)  # [R, G, V]
    gammas = [gamma_max] + torch.randint(0, gamma_max + 1, (rows - 1,), generator=g).tolist()
    greedy = (torch.rand(rows, generator=g) < 0.25).tolist()
    argmax = p.argmax(-1)  # [R, G+1]
    drafts = []
    for r, gamma in enumerate(gammas):
        drawn = torch.multinomial(q[r], 1, generator=g).squeeze(1)[:gamma].tolist()  # dᵢ ~ qᵢ
        if greedy[r]:  # the argmax for a random number of steps, then a draw
            follow = int(torch.randint(0, gamma + 1, (1,), generator=g))
            drawn = argmax[r, :follow].tolist() + drawn[follow:]
        drafts.append(drawn)
    generators = [None if greedy[r] else make_generator(1000 + r) for r in range(rows)]
    uniforms = row_uniforms(generators, [gamma + 1 for gamma in gammas], torch.device("cpu"))
    decided = decide(batch(p, drafts, q, greedy, uniforms)).to_host()
    outcomes = set()
    for r, gamma in enumerate(gammas):
        if greedy[r]:
            want = accept_greedy(drafts[r], argmax[r, :gamma + 1].tolist())
        else:
            given = GivenUniforms(uniforms[r, :gamma + 1].tolist())
            monkeypatch.setattr(acceptance, "torch", given)
            monkeypatch.setattr(acceptance, "sample", given.draw)
            q_rows = [SparseDist(tuple(range(VOCAB)), tuple(q[r, i].tolist())) for i in range(gamma)]
            want = accept_sampled(drafts[r], DraftQ.from_sparse(q_rows, drafts[r], VOCAB), p[r, :gamma + 1],
                                  generators[r])
            monkeypatch.undo()
            assert not given.values, "the reference left uniforms unused"
        assert decided[r] == (want.num_accepted, want.next_token, want.accept_probs), (r, gamma, greedy[r])
        outcomes.add((greedy[r], want.num_accepted == gamma))
    assert outcomes == {(True, True), (True, False), (False, True), (False, False)}  # every branch ran


def test_greedy_rows_decide_as_the_scalar_step():
    rows, gamma = 64, 4
    p = dists(rows * (gamma + 1), 1).reshape(rows, gamma + 1, VOCAB)
    argmax = p.argmax(-1)
    g = torch.Generator().manual_seed(2)
    drafts = []
    for r in range(rows):  # drafts that follow the argmax for a random number of steps
        keep = int(torch.randint(0, gamma + 1, (1,), generator=g))
        row = argmax[r, :gamma].tolist()
        if keep < gamma:
            row[keep] = (row[keep] + 1) % VOCAB
        drafts.append(row[:int(torch.randint(1, gamma + 1, (1,), generator=g))])
    q = torch.zeros(rows, gamma, VOCAB)
    decisions = decide(batch(p, drafts, q, [True] * rows, torch.zeros(rows, gamma + 1))).to_host()
    for r, (accepted, token, ratios) in enumerate(decisions):
        expected = accept_greedy(drafts[r], argmax[r, :len(drafts[r]) + 1].tolist())
        assert (accepted, token) == (expected.num_accepted, expected.next_token), r
        assert ratios == expected.accept_probs, r


def test_sampled_rows_of_different_lengths_follow_p():
    """One fixed position p₁, q₁ and a draft d₁ ~ q₁ per row: the first emitted token (d₁ if
    accepted, else the recovered one) follows p₁; rows of γ 1 and 3 share the batch."""
    rows = 40_000
    p1, q1 = dists(1, 3)[0], dists(1, 4, sharp=1.0)[0]
    later = dists(3, 5)  # positions 2, 3 and the bonus of γ = 3 rows
    g = torch.Generator().manual_seed(6)
    d1 = torch.multinomial(q1, rows, replacement=True, generator=g)  # [R]
    gammas = [1 if r % 2 else 3 for r in range(rows)]
    drafts = [[int(d1[r])] + [int(d1[r])] * (gamma - 1) for r, gamma in enumerate(gammas)]
    p = torch.cat([p1[None], later]).expand(rows, 4, VOCAB)
    q = torch.stack([q1, later[0], later[1]]).expand(rows, 3, VOCAB)
    uniforms = torch.rand(rows, 4, generator=g)
    decisions = decide(batch(p, drafts, q, [False] * rows, uniforms))
    first = torch.where(decisions.accepted > 0, d1, decisions.next_token)
    counts = np.bincount(first.numpy(), minlength=VOCAB)
    expected = p1.double().numpy()
    assert counts[expected == 0].sum() == 0
    assert chi2_pvalue(counts[expected > 0], expected[expected > 0]) > 1e-3
    rejected = decisions.accepted == 0
    assert 0 < int(rejected.sum()) < rows  # both branches ran


def test_the_scalar_rule_on_hand_built_rows():
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.0, 1.0]]]).expand(3, 2, 3)  # γ = 1
    q = torch.tensor([[[0.0, 1.0, 0.0]]]).expand(3, 1, 3)  # the draft was 1 with q = 1: ratio 0.5
    ids = torch.arange(3).expand(3, 1, 3)
    uniforms = torch.tensor([[0.2, 0.7], [0.6, 0.1], [0.6, 0.9]])
    chains = ChainBatch(p, torch.tensor([[1], [1], [1]]), torch.tensor([1, 1, 1]), ids, q,
                        torch.tensor([False] * 3), uniforms)
    decisions = decide(chains).to_host()
    assert decisions[0] == (1, 2, [0.5])  # 0.2 < 0.5: accepted, the bonus from p₂ = one-hot 2
    assert decisions[1] == (0, 2, [0.5]) == decisions[2]  # rejected: the residual is one-hot 2
    widths = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    assert inverse_cdf(widths, torch.tensor([0.0])).tolist() == [2]  # never a zero-mass id


def test_a_rows_draws_are_its_own_generators():
    counts = [3, 5, 2]  # γ + 1 draws of a verification row
    alone = row_uniforms([make_generator(7)], [3], torch.device("cpu"))
    together = row_uniforms([make_generator(7), make_generator(8), None], counts, torch.device("cpu"))
    assert together.shape == (3, 5)
    assert torch.equal(together[0, :3], alone[0, :3]) and not together[0, 3:].any()
    assert not together[2].any()  # greedy rows draw nothing
