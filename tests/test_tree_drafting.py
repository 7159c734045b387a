"""How the draft grows a tree (specdec/runtime/tree_drafting.py) on hand-built logits: the path
scores pick the children, the draft's own chain always stays, the cut keeps whole paths."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.tree_drafting import TREE_WIDTH, Growing, cut, extend
from specdec.types import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 10


def logits_for(*rows: dict[int, float]) -> torch.Tensor:
    """Rows of logits whose softmax puts these probabilities on these tokens (the rest share what is left)."""
    out = torch.full((len(rows), VOCAB), -30.0)
    for r, probs in enumerate(rows):
        for token, p in probs.items():
            out[r, token] = torch.log(torch.tensor(p))
    return out


def growing(budget: int, depths: int = 3) -> Growing:
    return Growing(0, "s", None, SamplingParams(0.0), depths, budget, base=5)


def test_children_by_path_score_and_the_spine_kept():
    g = growing(budget=8)
    extend(g, logits_for({1: 0.5, 2: 0.3, 3: 0.1, 4: 0.06, 5: 0.04}))  # the root's children
    assert g.tokens == [1, 2, 3, 4] and g.parents == [0, 0, 0, 0] and g.spine == [0]
    # depth 2: node 1 (p 0.5) is sure of 6 only a little; node 2 (p 0.3) is sure of 7
    extend(g, logits_for({6: 0.3, 8: 0.3, 9: 0.3}, {7: 0.99}, {1: 0.9}, {2: 0.9}))
    depth2 = list(zip(g.tokens[4:], g.parents[4:]))
    assert (7, 2) in depth2  # 0.3 × 0.99 beats 0.5 × 0.3
    assert g.spine[1] in range(4, 8) and g.parents[g.spine[1]] == 1  # the chain goes on under node 0
    assert len(depth2) == TREE_WIDTH


def test_the_spine_is_forced_in_when_its_score_is_low():
    g = growing(budget=8)
    extend(g, logits_for({1: 0.4, 2: 0.3, 3: 0.2, 4: 0.1}))
    # the spine's parent (token 1) is unsure; its siblings are sure of their next tokens
    extend(g, logits_for({5: 0.24, 6: 0.2, 7: 0.19, 8: 0.19, 9: 0.18}, {5: 0.99}, {6: 0.99}, {7: 0.99}))
    spine_child = g.spine[1]
    assert g.parents[spine_child] == 1 and g.tokens[spine_child] == 5  # node 0's argmax
    assert len(g.tokens) == 4 + TREE_WIDTH


def test_the_cut_keeps_the_spine_and_whole_paths():
    g = growing(budget=5)
    extend(g, logits_for({1: 0.5, 2: 0.3, 3: 0.1, 4: 0.1}))
    extend(g, logits_for({5: 0.6, 6: 0.4}, {7: 0.9, 8: 0.1}, {9: 1.0}, {9: 1.0}))
    extend(g, logits_for(*[{1: 1.0}] * len(g.frontier)))
    tree = cut(g)
    assert len(tree) == 5
    tree.check()
    spine_tokens = [g.tokens[i] for i in g.spine]
    paths = [[tree.tokens[i] for i in tree.path(node)] for node in range(len(tree))]
    assert spine_tokens in paths  # the draft's own chain, whole
    for node, parent in enumerate(tree.parents):  # every kept node's parent is kept (parents first)
        assert 0 <= parent <= node
    # a budget smaller than the depth keeps the top of the chain only
    g.budget = 2
    assert cut(g).tokens == tuple(spine_tokens[:2]) and cut(g).is_chain
