"""The acceptance step for every token tree of a verification batch, on the device, one host read.

`specdec/maths/tree_acceptance.py` walks one tree at a time and reads every test back to the host
(`float(...)`, a draw per node): on a GPU, several synchronisations per node. Here the same walk
runs for every tree row of a batch at once, trees padded to the batch's largest (nodes, children
per node, q width): a loop over the depth levels, and at each level over the child slots that
some node at that depth fills — Σ over levels of the widest node there, at most the number of
nodes — a fixed handful of tensor operations each, no host read inside. The caller reads the
paths, next tokens and bonus flags back once (`TreeDecisions.to_host`).

The rule is tree_acceptance.py's:
- greedy: at the current node follow the first child whose token is the target's argmax; where
  none is, the argmax is the target's token (a bonus below a leaf);
- sampled (SpecInfer's recursive rejection sampling): r₁ = p at the node, children tested in
  order, child j accepted when u < min(1, rⱼ(xⱼ)/qⱼ(xⱼ)), after a rejection
  rⱼ₊₁ = normalize(max(0, rⱼ − qⱼ)) (rⱼ kept where that is empty); every child rejected: the
  token is drawn from the last residual; below a leaf a bonus from p.

Draws: node i's test uses uniform i of its row and the one final draw (inverse CDF, as
batched_acceptance.inverse_cdf) uniform n, so a tree of n nodes takes n + 1 uniforms from its
request's own generator (`row_uniforms`) — a number set by its shape alone, each used at most
once, so a row's draws never depend on its neighbours in the batch. q arrives sparse per node
(any width, padded with probability 0). Any number of children per node is taken (the
draft's trees have at most TREE_WIDTH, a tree from the wire may have more): the batch pads to
its widest node, so no shape falls back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.maths.tree import TokenTree
from specdec.runtime.batched_acceptance import inverse_cdf


@dataclass(frozen=True)
class TreeLayout:
    """The shapes of a batch's trees as host tensors (a pure function of their structure)."""

    tokens: torch.Tensor    # [R, N] int64: each node's token, padded with 0
    children: torch.Tensor  # [R, N+1, C] int64: per logits row (0 the root, j node j − 1) its children in order, -1 padding
    sizes: torch.Tensor     # [R] int64: each tree's n (its final draw's uniform)
    widths: tuple[int, ...]  # per depth level (0 = the root), the most children of a node at that depth


@dataclass(frozen=True)
class TreeBatch:
    """One verification batch of trees, padded to the largest, on the device."""

    target_probs: torch.Tensor  # [R, N+1, vocab] float32: p per logits row (greedy rows: one-hot on the argmax)
    tokens: torch.Tensor        # [R, N] int64 (TreeLayout)
    children: torch.Tensor      # [R, N+1, C] int64 (TreeLayout)
    sizes: torch.Tensor         # [R] int64 (TreeLayout)
    widths: tuple[int, ...]     # host ints: the walk's loop bounds (TreeLayout)
    q_ids: torch.Tensor         # [R, N, K] int64: the ids of each node's sparse q
    q_probs: torch.Tensor       # [R, N, K] float32: their probabilities (0 where padded; greedy rows all 0)
    greedy: torch.Tensor        # [R] bool: the row decides by argmax (q unused)
    uniforms: torch.Tensor      # [R, N+1] float32 in [0, 1): node i's test at i, the final draw at n


@dataclass(frozen=True)
class TreeDecisions:
    """What the target decided for each tree, still on the device."""

    path: torch.Tensor        # [R, D] int64: the accepted nodes, root's child first, -1 after the last
    next_token: torch.Tensor  # [R] int64: the recovered or bonus token
    is_bonus: torch.Tensor    # [R] bool: the walk ended at a node without children
    tested: torch.Tensor      # [R] int64: children tested, accepted ones included (greedy: every child of
                              # a node on the path, as tree_acceptance.py counts them)

    def to_host(self) -> list[tuple[list[int], int, bool, int]]:
        """(path, next token, is_bonus, tested) per row: the batch's one host synchronisation."""
        columns = torch.stack([self.next_token, self.is_bonus.long(), self.tested], dim=1)  # [R, 3]
        both = torch.cat([columns, self.path], dim=1).tolist()  # [R, 3 + D]
        return [([node for node in row[3:] if node >= 0], row[0], bool(row[1]), row[2]) for row in both]


def tree_layout(trees: Sequence[TokenTree]) -> TreeLayout:
    """The padded structure of `trees` (host work on host data: no device involved)."""
    nodes = max(len(tree) for tree in trees)
    per_tree = [tree.children() for tree in trees]  # per tree, per logits row, its children
    width = max(len(under) for children in per_tree for under in children)
    tokens = torch.zeros((len(trees), nodes), dtype=torch.long)  # [R, N]
    children = torch.full((len(trees), nodes + 1, max(width, 1)), -1, dtype=torch.long)  # [R, N+1, C]
    levels: list[int] = []
    for r, (tree, rows) in enumerate(zip(trees, per_tree)):
        tokens[r, :len(tree)] = torch.tensor(tree.tokens, dtype=torch.long)
        depth_of_row = [0] + tree.depths()  # the root at depth 0
        for row, under in enumerate(rows):
            if under:
                children[r, row, :len(under)] = torch.tensor(under, dtype=torch.long)
            while len(levels) <= depth_of_row[row]:
                levels.append(0)
            levels[depth_of_row[row]] = max(levels[depth_of_row[row]], len(under))
    return TreeLayout(tokens, children, torch.tensor([len(tree) for tree in trees]), tuple(levels))


def decide_trees(batch: TreeBatch) -> TreeDecisions:
    """Every row's walk down its tree at once (module docstring)."""
    p = batch.target_probs
    rows, vocab = p.shape[0], p.shape[-1]
    at = torch.arange(rows, device=p.device)  # [R]
    current = torch.zeros(rows, dtype=torch.long, device=p.device)  # [R]: the logits row the walk is at
    done = torch.zeros(rows, dtype=torch.bool, device=p.device)  # [R]
    dist = torch.zeros_like(p[:, 0])  # [R, vocab]: what each finished row draws from
    final_row = torch.zeros_like(current)  # [R]: the logits row it finished at
    is_bonus = torch.zeros_like(done)  # [R]
    tested = torch.zeros_like(current)  # [R]
    path = []
    for width in batch.widths:  # depth levels: the walk goes down one each
        kids = batch.children[at, current]  # [R, C]
        residual = p[at, current]  # [R, vocab], r₁ = p
        argmax = residual.argmax(dim=-1)  # [R]
        taken = torch.full_like(current, -1)  # [R]: the accepted child, -1 none yet
        for slot in range(width):
            testing = ~done & (kids[:, slot] >= 0) & (taken < 0)  # [R]
            accept, residual = _test_child(batch, at, kids[:, slot].clamp(min=0), residual, argmax, testing)
            taken = torch.where(accept, kids[:, slot], taken)
            tested += (~done & (kids[:, slot] >= 0) & (batch.greedy | testing)).long()  # greedy: every child
        finishing = ~done & (taken < 0)  # [R]: every child rejected, or none to test
        dist = torch.where(finishing[:, None], residual, dist)
        final_row = torch.where(finishing, current, final_row)
        is_bonus |= finishing & (kids[:, 0] < 0)
        path.append(torch.where(done, -1, taken))
        current = torch.where(taken >= 0, taken + 1, current)
        done |= finishing
    drawn = inverse_cdf(dist, batch.uniforms[at, batch.sizes])  # [R]
    greedy_token = p[at, final_row].argmax(dim=-1)  # [R]
    next_token = torch.where(batch.greedy, greedy_token, drawn).clamp(max=vocab - 1)
    return TreeDecisions(torch.stack(path, dim=1), next_token, is_bonus, tested)


def _test_child(batch: TreeBatch, at: torch.Tensor, node: torch.Tensor, residual: torch.Tensor,
                argmax: torch.Tensor, testing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One child slot of every row: (accepted [R] bool, the residual after it [R, vocab]).
    node [R]: the child tested (a valid index where not testing); residual [R, vocab]: rⱼ."""
    token = batch.tokens[at, node]  # [R]
    q_ids, q_probs = batch.q_ids[at, node], batch.q_probs[at, node]  # [R, K] each
    q_of_token = ((q_ids == token[:, None]) * q_probs).sum(dim=-1)  # [R]
    r_of_token = residual.gather(1, token[:, None]).squeeze(1)  # [R]
    ratio = torch.clamp(r_of_token / q_of_token.clamp_min(torch.finfo(residual.dtype).tiny), max=1.0)
    sampled_ok = batch.uniforms[at, node] < ratio  # [R]
    accept = torch.where(batch.greedy, token == argmax, sampled_ok) & testing  # [R]
    q_dense = torch.zeros_like(residual).scatter_add_(1, q_ids, q_probs)  # [R, vocab]
    rest = torch.clamp(residual - q_dense, min=0.0)  # [R, vocab], max(0, r − q)
    total = rest.sum(dim=-1, keepdim=True)  # [R, 1]
    following = torch.where(total > 0, rest / total.clamp_min(torch.finfo(rest.dtype).tiny), residual)
    rejected = testing & ~accept & ~batch.greedy  # [R]
    return accept, torch.where(rejected[:, None], following, residual)
