"""The acceptance step over a token tree: walk down from the root, one child at a time.

Greedy: follow the child whose token is the target's argmax; where none is, the argmax is the
target's own token. Sampled: at each node, its children are tested in order by recursive
rejection sampling (SpecInfer's multi-step speculative sampling, Miao et al. 2024): child k with
proposal qₖ (one-hot for a child picked deterministically, e.g. the draft's top tokens or prompt
lookup) is accepted with probability min(1, rₖ(x)/qₖ(x)), where r₁ = p and, after a rejection,
rₖ₊₁ = normalize(max(0, rₖ − qₖ)). Each test is one speculative-sampling step whose output is
distributed as rₖ, a rejection handing on to a step that samples rₖ₊₁ exactly, so the token
that leaves a node is distributed as p whenever the children are independent of each other's
tests (picked deterministically, or drawn independently). When every child is rejected the
token is drawn from the last residual; below a leaf it is a bonus token drawn from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.maths.draft_q import DraftQ
from specdec.maths.sampling import sample
from specdec.maths.tree import TokenTree


@dataclass(frozen=True)
class TreeVerdict:
    """What the target decided over a tree."""

    path: list[int]      # the accepted nodes, root's child first
    next_token: int      # the target's own token after them (recovered or bonus)
    is_bonus: bool       # the last accepted node (or the root) had no children to test
    tested: int          # children tested, accepted ones included


def accept_tree_greedy(tree: TokenTree, target_argmax: list[int]) -> TreeVerdict:
    """target_argmax: [1 + n] the target's argmax at the root and at each node."""
    children = tree.children()
    row, path, tested = 0, [], 0
    while True:
        want = target_argmax[row]
        under = children[row]
        tested += len(under)
        match = next((node for node in under if tree.tokens[node] == want), None)
        if match is None:
            return TreeVerdict(path, want, not under, tested)
        path.append(match)
        row = match + 1


def accept_tree_sampled(tree: TokenTree, draft_q: DraftQ, target_probs: torch.Tensor,
                        generator: torch.Generator) -> TreeVerdict:
    """draft_q: a row per node (the q its token came from); target_probs p: [1 + n, vocab]
    float32 on the generator's device (module docstring)."""
    children = tree.children()
    row, path, tested = 0, [], 0
    while True:
        under = children[row]
        residual = target_probs[row]  # [vocab], r₁ = p
        for node in under:
            tested += 1
            token = tree.tokens[node]
            ratio = min(1.0, float(residual[token]) / float(draft_q.of_drafts[node]))
            u = float(torch.rand(1, generator=generator, device=generator.device))
            if u < ratio:
                break
            rest = draft_q.residual(node, residual)  # [vocab], max(0, r − q)
            total = float(rest.sum())
            residual = rest / total if total > 0 else residual
        else:
            return TreeVerdict(path, sample(residual, generator), not under, tested)
        path.append(node)
        row = node + 1
