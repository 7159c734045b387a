"""A draft that grows a token tree: one forward per depth, EAGLE-2's way.

From the root (the session's last token) each depth keeps the TREE_WIDTH candidates with the
highest path score — the product of the draft's probabilities along the path — among the
children of the previous depth's nodes, and runs them in one forward (each node masked to the
history and its own ancestors, specdec/runtime/batch_cache.place_trees), batched with the
other calls' trees. The draft's own chain — its likeliest token after each one, what a chain
round would propose — is always kept (the spine), so a tree holds the chain of its depth and
adds alternatives beside it. After num_speculative_tokens depths the tree is cut to the spine
plus its best other nodes by path score, tree_nodes in all (ancestors score at least as high as
their children, so the cut keeps whole paths). Children are picked by rank, deterministically,
so each node's q is one-hot on its token: the target's recursive rejection sampling stays exact
(docs/design.md). The session keeps only its history's K/V: the next call sends the path the
target accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.session_kv import Row, SessionKV
from specdec.maths.sampling import proposal_top_k
from specdec.maths.tree import TREE_WIDTH, TokenTree, subtree
from specdec.types import Proposal, SamplingParams, SparseDist


@dataclass
class Growing:
    """One call's tree while it grows."""

    index: int                # the call's place in the batch
    session_id: str
    entry: SessionCache
    params: SamplingParams
    depths: int               # depths to grow (num_speculative_tokens)
    budget: int               # nodes to keep (tree_nodes)
    base: int                 # history tokens (what the session keeps)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # as on the wire: 0 the root, j node j − 1
    scores: list[float] = field(default_factory=list)  # path score of each node
    frontier: list[int] = field(default_factory=lambda: [-1])  # the last depth's nodes (-1: the root)
    spine: list[int] = field(default_factory=list)  # the draft's own chain: its likeliest child at each depth
    grown: int = 0            # depths grown so far

    def tree(self) -> TokenTree:
        return TokenTree(tuple(self.tokens), tuple(self.parents))

    def spine_parent(self) -> int:
        """The node the spine goes on under (-1: the root)."""
        return self.spine[-1] if self.spine else -1


def candidates(logits: torch.Tensor, params: SamplingParams, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` likeliest children of each row and the draft's probability of each: the
    request's warped proposal when sampling, the softmax at T = 1 when greedy.
    logits [f, vocab] -> (ids [f, w], probs [f, w]), most likely first."""
    if params.greedy:
        best = torch.topk(torch.softmax(logits.float(), dim=-1), min(width, logits.shape[-1]), dim=-1)
        return best.indices, best.values
    return proposal_top_k(logits, params, width)


def extend(growing: Growing, logits: torch.Tensor) -> None:
    """One depth: the TREE_WIDTH best children of the frontier by path score. logits [f, vocab].
    The pool is sorted by path score, stably in (frontier row, rank) order: ties keep the
    earlier row's, then the likelier child (the device's batched depth, batched_tree_drafting.py,
    keeps the same order)."""
    ids, probs = candidates(logits, growing.params, TREE_WIDTH)  # [f, w]
    pool: list[tuple[float, int, int]] = []  # (path score, parent node or -1, token)
    for row, parent in enumerate(growing.frontier):
        above = 1.0 if parent < 0 else growing.scores[parent]
        for token, prob in zip(ids[row].tolist(), probs[row].tolist()):
            if prob > 0:
                pool.append((above * prob, parent, token))
    spine_parent = growing.spine_parent()
    row = growing.frontier.index(spine_parent) if spine_parent in growing.frontier else None
    pool.sort(key=lambda c: -c[0])
    kept = pool[:TREE_WIDTH]
    chain = None  # (parent, token) of the spine's next node
    if row is not None and probs[row, 0] > 0:  # the spine goes on with its parent's likeliest child
        chain = (spine_parent, int(ids[row, 0]))
        if not any((parent, token) == chain for _, parent, token in kept):
            above = 1.0 if spine_parent < 0 else growing.scores[spine_parent]
            kept = kept[:TREE_WIDTH - 1] + [(above * float(probs[row, 0]), *chain)]
    keep(growing, kept, chain)


def keep(growing: Growing, kept: Sequence[tuple[float, int, int]], chain: tuple[int, int] | None) -> None:
    """Add a depth's kept children, in order — (path score, parent node or -1, token) each; the
    one equal to `chain` (parent, token) continues the spine — as the new frontier."""
    growing.frontier = []
    for score, parent, token in kept:
        if (parent, token) == chain:
            growing.spine.append(len(growing.tokens))
        growing.tokens.append(token)
        growing.parents.append(parent + 1)
        growing.scores.append(score)
        growing.frontier.append(len(growing.tokens) - 1)
    growing.grown += 1


def cut(growing: Growing) -> TokenTree:
    """The spine (as deep as the budget allows), then the best other nodes by path score (ties:
    the earlier node, so a parent comes first), tree_nodes in all."""
    spine = growing.spine[:growing.budget]
    on_spine = set(spine)
    others = sorted((i for i in range(len(growing.tokens)) if i not in on_spine),
                    key=lambda i: (-growing.scores[i], i))
    # closed under parents: a kept node's parent is the root, on the spine, or ranked before it
    return subtree(growing.tree(), sorted(spine + others[:growing.budget - len(spine)]))


TreeCalls = Sequence[tuple[int, SessionCache, Sequence[int], object]]  # (index, entry, feed, ProposeCall)


def start_trees(calls: TreeCalls) -> tuple[list[Growing], list[Row]]:
    """Each call's growing tree and the row of its first forward (its feed, the root last)."""
    live = [Growing(index, call.session_id, entry, call.params, call.gamma, call.tree_nodes,
                     len(entry) + len(feed)) for index, entry, feed, call in calls]
    return live, [Row(g.session_id, g.entry, list(feed), 1) for g, (_, _, feed, _) in zip(live, calls)]


def growing_on(growing: Growing) -> bool:
    """Whether a tree grows another depth."""
    return growing.grown < growing.depths and bool(growing.frontier)


def finish_tree(engine: SessionKV, growing: Growing) -> Proposal:
    """A grown tree's Proposal (cut to its budget); the session keeps its history only: the next
    call sends the path the target accepted."""
    tree = cut(growing)
    growing.entry.crop(growing.base)
    return Proposal(list(tree.tokens), [SparseDist.one_hot(t) for t in tree.tokens], len(growing.entry), 0,
                    engine.take_restored(growing.session_id), parents=tree.parents)


def grow_trees(engine: SessionKV, calls: TreeCalls, results: list) -> None:
    """calls: (index, entry, tokens to feed, the ProposeCall) of calls asking for trees, their
    sessions rolled back already; each result (a Proposal with parents, or the exception) goes
    to results[index]. One forward for the feed, then one per depth, for every tree at once,
    each depth picked on the host call by call (the graph engine picks them on the device,
    graph/tree_loop.py)."""
    live, rows = start_trees(calls)
    while live:
        try:
            for growing, logits in zip(live, engine.forward_batch(rows)):  # per row [frontier, vocab]
                extend(growing, logits)
        except Exception as exc:  # noqa: BLE001 - every call in the forward failed with it
            for growing in live:
                growing.entry.crop(growing.base)
                results[growing.index] = exc
            return
        for growing in live:
            if not growing_on(growing):
                results[growing.index] = finish_tree(engine, growing)
        live = [growing for growing in live if growing_on(growing)]
        rows = [Row(g.session_id, g.entry, [g.tokens[i] for i in g.frontier], len(g.frontier), g.tree())
                for g in live]
