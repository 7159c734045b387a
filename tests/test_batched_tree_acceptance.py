"""The batched, on-device acceptance step over token trees
(specdec/maths/batched_tree_acceptance.py) against the reference it implements
(specdec/maths/tree_acceptance.py): greedy walks equal accept_tree_greedy's on many random
trees, and sampled walks accept_tree_sampled's, row by row, given the same uniforms (random
trees, p, sparse q and seeds); sampled output follows p (one pooled chi-square over the first
token and the 2-token path, one-hot and non-one-hot q, trees whose children are all rejected);
and through the graph engine's DeviceVerification, a batch of trees and chains with different seeds
gives each row what it gets alone, greedy rows what the host verifier gives."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.config import TargetConfig
from specdec.maths.draft_q import DraftQ
from specdec.maths.tree import TokenTree
from specdec.maths import tree_acceptance
from specdec.maths.tree_acceptance import accept_tree_greedy, accept_tree_sampled
from specdec.maths.batched_acceptance import row_uniforms
from specdec.maths.batched_tree_acceptance import TreeBatch, decide_trees, tree_layout
from specdec.runtime.graph.device_verification import DeviceVerification
from specdec.runtime.engines import engine_from_config
from specdec.runtime.generators import make_generator
from specdec.runtime.verification import HostVerification
from specdec.types import SamplingParams, SparseDist
from tests.test_batched_acceptance import GivenUniforms
from tests.test_sampling import chi2_pvalue

VOCAB = 12


def random_tree(rng: random.Random, nodes: int, vocab: int = VOCAB) -> TokenTree:
    """A tree of `nodes` nodes, parents first, no token repeated under a parent; some nodes with
    more children than the draft's TREE_WIDTH."""
    tokens: list[int] = []
    parents: list[int] = []
    while len(tokens) < nodes:
        parent, token = rng.randint(0, len(tokens)), rng.randrange(vocab)
        if (parent, token) not in set(zip(parents, tokens)):
            parents.append(parent)
            tokens.append(token)
    tree = TokenTree(tuple(tokens), tuple(parents))
    tree.check()
    return tree


def batch_of(trees: list[TokenTree], p: torch.Tensor, q: DraftQ | None, greedy: bool,
             uniforms: torch.Tensor) -> TreeBatch:
    """p [R, N+1, V]; q: every row's nodes' q (None: greedy rows, no q)."""
    return TreeBatch(p.float(), tree_layout(trees, [q] * len(trees)), torch.full((len(trees),), greedy), uniforms,
                     not greedy)


def sparse(rows: list[tuple[list[int], list[float]]]) -> DraftQ:
    """A DraftQ of per-node (ids, probs)."""
    return DraftQ(tuple(torch.tensor(ids) for ids, _ in rows), tuple(torch.tensor(probs) for _, probs in rows),
                  torch.zeros(len(rows)))


@pytest.mark.unit
def test_greedy_walks_equal_accept_tree_greedy_on_random_trees():
    rng = random.Random(0)
    trees = [random_tree(rng, rng.randint(2, 12)) for _ in range(400)]
    nodes = max(len(tree) for tree in trees)
    argmax = torch.zeros((len(trees), nodes + 1), dtype=torch.long)
    for r, tree in enumerate(trees):  # the argmax follows a child most of the time, so walks go deep
        for row, under in enumerate(tree.children()):
            follow = under and rng.random() < 0.75
            argmax[r, row] = tree.tokens[rng.choice(under)] if follow else rng.randrange(VOCAB)
    p = torch.nn.functional.one_hot(argmax, VOCAB)  # [R, N+1, V]
    decided = decide_trees(batch_of(trees, p, None, True, torch.zeros(len(trees), nodes + 1))).to_host()
    depths = []
    for r, tree in enumerate(trees):
        want = accept_tree_greedy(tree, argmax[r, :len(tree) + 1].tolist())
        assert decided[r] == (want.path, want.next_token, want.is_bonus, want.tested), (r, tree)
        depths.append(len(want.path))
    assert max(depths) >= 4 and min(depths) == 0 and any(len(u) > 4 for t in trees for u in t.children())


def walk_order(tree: TokenTree, path: list[int], tested: int) -> list[int]:
    """The nodes a walk that accepted `path` tested, in the order it tested them: at each node
    its children up to the accepted one, below the last every child (all rejected)."""
    children, order, row = tree.children(), [], 0
    for node in path:
        under = children[row]
        order += under[:under.index(node) + 1]
        row = node + 1
    order += children[row]
    assert len(order) == tested
    return order


@pytest.mark.unit
def test_sampled_walks_decide_as_the_reference_with_the_same_uniforms(monkeypatch):
    """Random trees (some wider than TREE_WIDTH), p, sparse q of random widths and seeds, in one
    batch: each row decides what accept_tree_sampled decides when its walk draws the uniforms the
    batched form gives the nodes it tests (node i's test uniform i, the draw uniform n). The
    nodes it does not test keep their own uniforms, which must change nothing."""
    rng, g = random.Random(7), torch.Generator().manual_seed(8)
    trees = [random_tree(rng, rng.randint(1, 10)) for _ in range(300)]
    nodes = max(len(tree) for tree in trees)
    p = torch.softmax(torch.randn(len(trees), nodes + 1, VOCAB, generator=g) * 1.5, -1)  # [R, N+1, V]
    qs = []
    for tree in trees:  # per node a q over a random subset of ids that holds its token
        rows = []
        for token in tree.tokens:
            ids = sorted({token, *rng.sample(range(VOCAB), rng.randint(0, VOCAB - 1))})
            probs = torch.softmax(torch.randn(len(ids), generator=g), -1).tolist()
            rows.append(SparseDist(tuple(ids), tuple(probs)))
        qs.append(DraftQ.from_sparse(rows, list(tree.tokens), VOCAB))
    uniforms = row_uniforms([make_generator(2000 + r) for r in range(len(trees))], [len(t) + 1 for t in trees],
                            torch.device("cpu"))  # [R, N+1]
    decided = decide_trees(TreeBatch(p, tree_layout(trees, qs), torch.zeros(len(trees), dtype=torch.bool),
                                     uniforms, True)).to_host()
    outcomes = set()
    for r, tree in enumerate(trees):
        walk = GivenUniforms(torch.rand(len(tree) + 1, generator=g).tolist())  # in the order drawn
        monkeypatch.setattr(tree_acceptance, "torch", walk)
        monkeypatch.setattr(tree_acceptance, "sample", walk.draw)
        drawn = list(walk.values)
        want = accept_tree_sampled(tree, qs[r], p[r, :len(tree) + 1], make_generator(0))
        monkeypatch.undo()
        given = uniforms[r].clone()  # the batched form's uniforms, the walk's where it drew them
        order = walk_order(tree, want.path, want.tested)
        given[order] = torch.tensor(drawn[:len(order)])
        given[len(tree)] = drawn[len(order)]
        n = len(tree)
        again = decide_trees(TreeBatch(p[r:r + 1, :n + 1], tree_layout([tree], [qs[r]]), torch.zeros(1, dtype=torch.bool),
                                       given[None, :n + 1], True)).to_host()[0]
        assert again == (want.path, want.next_token, want.is_bonus, want.tested), (r, tree)
        outcomes.add((bool(want.path), want.is_bonus))
        # the batch's own uniforms: the reference with those, in walk order, decides the same
        order = walk_order(tree, decided[r][0], decided[r][3])
        walk = GivenUniforms([*uniforms[r, order].tolist(), float(uniforms[r, len(tree)])])
        monkeypatch.setattr(tree_acceptance, "torch", walk)
        monkeypatch.setattr(tree_acceptance, "sample", walk.draw)
        want = accept_tree_sampled(tree, qs[r], p[r, :len(tree) + 1], make_generator(0))
        monkeypatch.undo()
        assert decided[r] == (want.path, want.next_token, want.is_bonus, want.tested), (r, tree)
    assert outcomes == {(False, False), (True, False), (True, True)}  # rejected at the root, deeper, a bonus


def dists(rows: int, seed: int, sharp: float = 1.5) -> torch.Tensor:
    """[rows, VOCAB] random distributions, token 11 outside every support."""
    probs = torch.softmax(torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * sharp, -1)
    probs[:, VOCAB - 1] = 0.0
    return probs / probs.sum(-1, keepdim=True)


def pooled_pvalue(first: torch.Tensor, second: torch.Tensor, p_root: torch.Tensor, p_after: torch.Tensor) -> float:
    """One chi-square over every sample's 2-token path (a, b): expected N p(a) p_after[a](b)."""
    observed = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).numpy()
    expected = (len(first) * p_root[:, None] * p_after).flatten().double().numpy()  # [V·V]
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was emitted"
    return chi2_pvalue(observed[expected > 0], expected[expected > 0])


@pytest.mark.unit
@pytest.mark.parametrize("proposal", ["one-hot", "drawn-from-q", "all-rejected"])
def test_sampled_walks_follow_p_over_the_first_two_tokens(proposal):
    """Three children of the root, a grandchild under the first; p at a node depends on its
    token alone (p_after), as the target's next round after that token would. one-hot:
    children are the draft's top tokens (q one-hot); drawn-from-q: each child drawn from its own
    q independently (q not one-hot, children may repeat); all-rejected: p at the root is zero on every child's token."""
    rows = 12_000
    g = torch.Generator().manual_seed(11)
    p_root, p_after, q_rows = dists(1, 1)[0], dists(VOCAB, 2), dists(4, 3, sharp=1.0)
    if proposal == "drawn-from-q":
        tokens = torch.stack([torch.multinomial(q_rows[k], rows, replacement=True, generator=g) for k in range(4)], 1)
        q = sparse([(list(range(VOCAB)), q_rows[k].tolist()) for k in range(4)])  # every id, some of them 0
    else:
        top = (torch.tensor([VOCAB - 1, 0, 1, 2]) if proposal == "all-rejected" else torch.tensor([3, 5, 0, 7]))
        if proposal == "all-rejected":
            p_root = p_root.clone()
            p_root[top[:3]] = 0.0
            p_root /= p_root.sum()
        tokens = top.expand(rows, 4)
        q = sparse([([token], [1.0]) for token in top.tolist()])
    trees = [TokenTree(tuple(row), (0, 0, 0, 1)) for row in tokens.tolist()]  # [R] trees of 4 nodes
    p = torch.cat([p_root.expand(rows, 1, VOCAB), p_after[tokens]], dim=1)  # [R, 5, V]
    decisions = decide_trees(batch_of(trees, p, q, False, torch.rand(rows, 5, generator=g)))
    out = decisions.to_host()
    emitted = [[tree.tokens[n] for n in path] + [token] for tree, (path, token, _, _) in zip(trees, out)]
    first = torch.tensor([e[0] for e in emitted])  # [R]
    # the second token: this round's where its first was accepted (the next node, or the bonus or
    # recovered token below it), else the next round's, a draw from p after the first
    next_round = torch.multinomial(p_after[first], 1, generator=g).squeeze(1)  # [R]
    second = torch.tensor([e[1] if len(e) > 1 else int(n) for e, n in zip(emitted, next_round)])
    assert pooled_pvalue(first, second, p_root, p_after) > 1e-3
    accepted = (decisions.path[:, 0] >= 0).float().mean()
    if proposal == "all-rejected":
        assert accepted == 0 and (decisions.tested == 3).all() and not decisions.is_bonus.any()
    else:
        assert 0.2 < accepted < 1.0  # both branches ran
        assert (decisions.path[:, 1] >= 0).any() and decisions.is_bonus.any()  # a grandchild, a bonus


@pytest.fixture(scope="module")
def target(small_vocab_models):
    """The 12-token target on the graph engine, float64."""
    return engine_from_config(TargetConfig(model=small_vocab_models["target"], backend="graph", dtype="float64",
                                           kv_cache_bytes=8 << 20))


HISTORY = [5, 9, 1, 3, 10, 7, 2]


def greedy_next(target, tokens: list[int], n: int) -> list[int]:
    """The target's own n greedy tokens after `tokens`."""
    out: list[int] = []
    for _ in range(n):
        entry, feed = target.begin("greedy", 0, 0, tokens + out)
        out.append(int(target.forward("greedy", entry, feed, 1)[-1].argmax()))
        target.release("greedy")
        target.finish(())
    return out


def others(avoid: int, n: int) -> list[int]:
    """n tokens other than `avoid` (siblings the target rejects)."""
    return [t for t in range(VOCAB) if t != avoid][:n]


def rows_of(target) -> list[tuple]:
    """(drafts, parents (empty: a chain), sampling, seed) per row; the greedy trees hold the
    target's own path beside rejected siblings (row 3: five children of the root, the 4th its
    token; row 4: down to a leaf, so a bonus)."""
    a = greedy_next(target, HISTORY + [3], 3)
    b = greedy_next(target, HISTORY + [4], 3)
    return [
        ((4, 6, 8, 1, 2, 3), (0, 0, 0, 1, 1, 4), SamplingParams(temperature=1.0), 11),
        ((4, 6, 8), (), SamplingParams(temperature=0.8, top_k=6), 12),
        ((3, 9, 5, 6, 0), (0, 1, 1, 0, 4), SamplingParams(temperature=1.3), 13),
        ((*others(a[0], 3), a[0], others(a[0], 4)[3], a[1], others(a[2], 1)[0]), (0, 0, 0, 0, 0, 4, 6),
         SamplingParams(temperature=0.0), 14),
        ((b[0], others(b[0], 1)[0], others(b[1], 1)[0], b[1], b[2]), (0, 0, 1, 1, 4), SamplingParams(temperature=0.0),
         15),
    ]


def verify(verifier, rows, prefix="s"):
    """One verify_batch over `rows`, each its own fresh session of HISTORY: (verdict, the
    session's tokens after) per row; q one-hot (as prompt lookup's or a rank-picked tree)."""
    calls = [verifier.call(f"{prefix}{i}", 0, 0, HISTORY + [i], list(drafts),
                           [SparseDist.one_hot(t) for t in drafts] if not params.greedy else [],
                           params, seed, top_logprobs=2, draft_parents=parents)
             for i, (drafts, parents, params, seed) in rows]
    verdicts = verifier.verify_batch(calls)
    kept = [list(verifier.engine.caches.get(call.session_id).tokens) for call in calls]
    for call in calls:
        verifier.engine.release(call.session_id)
    verifier.engine.finish(())
    return list(zip(verdicts, kept))


@pytest.mark.service
def test_a_row_decides_alike_alone_and_beside_others_and_greedy_rows_as_the_host(target):
    rows = rows_of(target)
    device = target.verification()
    assert isinstance(device, DeviceVerification)
    together = verify(device, list(enumerate(rows)))
    assert device.decided == {"chains": 1, "trees": 4}  # every row on the device, none on the host
    for i, row in enumerate(rows):
        alone = verify(device, [(i, row)], prefix="alone")
        assert alone == [together[i]], i
    for i, (verdict, kept) in enumerate(together):
        assert not isinstance(verdict, Exception), verdict
        assert kept == HISTORY + [i] + verdict.committed(list(rows[i][0]))[:-1]  # only the accepted path's K/V
        assert len(verdict.logprobs) == verdict.num_accepted + 1
    assert [(v.accepted_nodes, v.is_bonus) for v, _ in together[3:]] == [((3, 5), False), ((0, 3, 4), True)]
    host = verify(HostVerification(target), [(i, rows[i]) for i in (3, 4)])
    assert [together[3], together[4]] == host  # greedy trees: the host walk's path, token, K/V, logprobs


@pytest.mark.service
def test_a_tree_too_wide_for_the_device_step_is_decided_on_the_host(target, monkeypatch):
    import specdec.maths.batched_tree_acceptance as module

    monkeypatch.setattr(module, "MAX_POINTS", 4)  # 3 children × (one-hot q + 1) = 6 points: too many
    rows = rows_of(target)
    device = target.verification()
    (verdict, kept), = verify(device, [(0, rows[0])])
    assert device.decided == {"chains": 0, "trees": 0}  # the host walk decided it
    assert kept == HISTORY + [0] + verdict.committed(list(rows[0][0]))[:-1]
    (on_device, _), = verify(device, [(4, rows[4])])  # greedy, two children of a node: 2 × 1 points fit
    assert device.decided["trees"] == 1 and on_device.accepted_nodes == (0, 3, 4)
