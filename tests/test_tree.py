"""Token trees (specdec/maths/tree.py) and their acceptance step (specdec/maths/tree_acceptance.py) on
hand-built trees and logits."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.maths.draft_q import DraftQ
from specdec.errors import InvalidArgument
from specdec.maths.sampling import target_probs
from specdec.runtime.torch.batch_cache import ancestor_mask
from specdec.maths.tree import TokenTree, graft, subtree
from specdec.maths.tree_acceptance import accept_tree_greedy, accept_tree_sampled
from specdec.types import SamplingParams

pytestmark = pytest.mark.unit

#        root
#       /    \
#     n0(5)  n1(6)
#     /  \      \
#  n2(7) n3(8)  n4(9)
#    |
#  n5(1)
TREE = TokenTree((5, 6, 7, 8, 9, 1), (0, 0, 1, 1, 2, 3))


def test_shape_of_a_hand_built_tree():
    assert TREE.depths() == [1, 1, 2, 2, 2, 3]
    assert TREE.children() == [[0, 1], [2, 3], [4], [5], [], [], []]
    assert TREE.path(5) == [0, 2, 5] and TREE.path(4) == [1, 4] and TREE.path(0) == [0]
    assert not TREE.is_chain and TokenTree.chain([3, 4, 5]).is_chain
    assert TokenTree.chain([3, 4, 5]).parents == (0, 1, 2)
    assert subtree(TREE, [0, 2, 5]) == TokenTree.chain([5, 7, 1])


def test_each_node_sees_exactly_its_ancestors():
    mask = ancestor_mask(TREE)
    for i in range(len(TREE)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(TREE.path(i)), i


@pytest.mark.parametrize("path, max_nodes, grown", [
    # follows n0 and n3, then hangs 4 under n3
    ((5, 8, 4), 16, TokenTree((5, 6, 7, 8, 9, 1, 4), (0, 0, 1, 1, 2, 3, 4))),
    # leaves at the root at once: a new child of the root, then its chain
    ((2, 3), 16, TokenTree((5, 6, 7, 8, 9, 1, 2, 3), (0, 0, 1, 1, 2, 3, 0, 7))),
    # all of it already in the tree: nothing added
    ((5, 7, 1), 16, TREE),
    # the spine's leaf n5 gains a grafted first child
    ((5, 7, 1, 3), 16, TokenTree((5, 6, 7, 8, 9, 1, 3), (0, 0, 1, 1, 2, 3, 6))),
    # the budget: at most 7 nodes in all
    ((2, 3), 7, TokenTree((5, 6, 7, 8, 9, 1, 2), (0, 0, 1, 1, 2, 3, 0))),
    ((2, 3), 6, TREE),
])
def test_a_grafted_branch_follows_the_nodes_it_repeats(path, max_nodes, grown):
    out = graft(TREE, path, max_nodes)
    assert out == grown
    out.check()  # no token twice under one parent
    assert out.tokens[:len(TREE)] == TREE.tokens and out.parents[:len(TREE)] == TREE.parents
    if len(out) > len(TREE):  # the last node added ends a path spelling the branch's start
        spelled = [out.tokens[node] for node in out.path(len(out) - 1)]
        assert spelled == list(path[:len(spelled)])


@pytest.mark.parametrize("parents, message", [
    ((0, 2), "draft_parents[1] is 2"), ((0,), "needs 2 parents"), ((1, 0), "draft_parents[0] is 1")])
def test_malformed_trees_are_refused(parents, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        TokenTree((5, 6), parents).check()
    with pytest.raises(InvalidArgument, match="repeats token 5"):
        TokenTree((5, 5), (0, 0)).check()


def test_greedy_follows_the_argmax_child():
    # rows: root, n0..n5. The argmax at the root is 6 (n1), at n1 it is 9 (n4), at n4 it is 3.
    argmax = [6, 0, 9, 0, 0, 3, 0]
    verdict = accept_tree_greedy(TREE, argmax)
    assert verdict.path == [1, 4] and verdict.next_token == 3 and verdict.is_bonus
    # the argmax at the root is no child: nothing accepted, the argmax is the recovered token
    verdict = accept_tree_greedy(TREE, [2, 0, 0, 0, 0, 0, 0])
    assert verdict.path == [] and verdict.next_token == 2 and not verdict.is_bonus
    # down the deepest branch: n0 (5), n2 (7), n5 (1), then a bonus token below the leaf
    verdict = accept_tree_greedy(TREE, [5, 7, 0, 1, 0, 0, 4])
    assert verdict.path == [0, 2, 5] and verdict.next_token == 4 and verdict.is_bonus


VOCAB = 6


def _p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    observed, probs = observed.double(), probs.double()
    keep = probs > 0
    assert int(observed[~keep].sum()) == 0, "a token with probability 0 was emitted"
    if int(keep.sum()) < 2:
        return 1.0  # one possible token: nothing to fit (the line above checked it)
    expected = probs[keep] / probs[keep].sum() * observed[keep].sum()
    return float(chisquare(observed[keep].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6), SamplingParams(1.3, top_k=4),
                                    SamplingParams(0.9, top_p=0.8)], ids=["t1", "t0.6", "topk", "topp"])
def test_sampled_tree_emits_the_target_distribution(width, params):
    """Children picked deterministically (the draft's top tokens, one-hot q), and one grandchild
    under the first: the first emitted token is distributed as p at the root, the second (after
    the first child) as p at that child."""
    generator = torch.Generator().manual_seed(width * 100 + int(params.temperature * 10))
    logits = torch.randn(1 + width + 1, VOCAB, generator=torch.Generator().manual_seed(width))  # [1 + n, vocab]
    p = target_probs(logits, params)  # [1 + n, vocab]
    draft_order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7)).tolist()
    tokens = tuple(draft_order[:width]) + (draft_order[width],)
    tree = TokenTree(tokens, tuple([0] * width) + (1,))
    q = DraftQ.from_dense(torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float(), list(tokens))
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    draws = 4000
    for _ in range(draws):
        verdict = accept_tree_sampled(tree, q, p, generator)
        emitted = [tree.tokens[n] for n in verdict.path] + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.path[:1] == [0]:
            second[emitted[1]] += 1
    assert _p_value(first, p[0]) > 1e-4
    assert second.sum() == first[tokens[0]]  # the first child accepted: the grandchild's row decides
    if second.sum() >= 300:  # (a first child the warp drops is never accepted)
        assert _p_value(second, p[1]) > 1e-4


@pytest.mark.parametrize("width", [2, 3])
def test_sampled_children_drawn_independently_from_q(width):
    """Children each drawn from its own q (as a sampling draft does): still p at the root."""
    generator = torch.Generator().manual_seed(width)
    p = torch.softmax(torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)), dim=-1)  # [1, vocab]
    q_rows = torch.softmax(torch.randn(width, VOCAB, generator=torch.Generator().manual_seed(4)) * 2, dim=-1)
    counts = torch.zeros(VOCAB)
    for _ in range(4000):
        tokens = [int(torch.multinomial(q_rows[k], 1, generator=generator)) for k in range(width)]
        tree = TokenTree(tuple(tokens), tuple([0] * width))
        q = DraftQ.from_dense(q_rows, tokens)
        verdict = accept_tree_sampled(tree, q, torch.cat([p, p.expand(width, -1)]), generator)
        counts[([tree.tokens[n] for n in verdict.path] + [verdict.next_token])[0]] += 1
    assert _p_value(counts, p[0]) > 1e-4


def test_more_children_accept_more_often():
    """The point of a tree: at the same target row, a second candidate catches what the first missed."""
    p = torch.tensor([[0.4, 0.35, 0.25, 0.0, 0.0, 0.0]]).expand(3, -1).contiguous()
    accepted = {}
    for width in (1, 2):
        generator = torch.Generator().manual_seed(0)
        tokens = (0, 1)[:width]
        tree = TokenTree(tokens, (0,) * width)
        q = DraftQ.from_dense(torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float(), list(tokens))
        accepted[width] = sum(bool(accept_tree_sampled(tree, q, p[:1 + width], generator).path)
                              for _ in range(4000)) / 4000
    assert accepted[1] == pytest.approx(0.4, abs=0.03) and accepted[2] == pytest.approx(0.75, abs=0.03)
