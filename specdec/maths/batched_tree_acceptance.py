"""The acceptance step for every token tree of a verification batch, on the device, one host read.

`specdec/maths/tree_acceptance.py` walks one tree at a time and reads every test back to the host
(`float(...)`, a draw per node): on a GPU, several synchronisations per node. Here every tree
row of a batch is decided at once, trees padded to the batch's largest, and the caller reads the
paths, next tokens and bonus flags back once (`TreeDecisions.to_host`).

The rule is tree_acceptance.py's:
- greedy: at the current node follow the first child whose token is the target's argmax; where
  none is, the argmax is the target's token (a bonus below a leaf);
- sampled (SpecInfer's recursive rejection sampling): r₁ = p at the node, children tested in
  order, child j accepted when u < min(1, rⱼ(xⱼ)/qⱼ(xⱼ)), after a rejection
  rⱼ₊₁ = normalize(max(0, rⱼ − qⱼ)) (rⱼ kept where that is empty); every child rejected: the
  token is drawn from the last residual; below a leaf a bonus from p.

How, with no loop over rows, nodes or depth:
- Whether child j would be accepted *if the walk reached it* depends only on its parent's p,
  the earlier siblings' q (all rejected, or the walk would not test it) and its own uniform. So
  every node's test is computed at once, for all parents together, in a loop over the child
  slot j (≤ the batch's most children of one node): a fixed handful of operations per slot.
- rⱼ differs from p only at the tokens of the earlier siblings' q, up to a scale. Each logits
  row keeps its residual at those "points" only (each child's token and q ids, W per row; a
  token repeated among them counted once), unnormalised, with its total; the mass elsewhere is
  p's. For a rank-picked tree (q one-hot) a row's points are its children's tokens.
- The accepted path follows, per row, the first child whose test passes, from the root down:
  a node is on it when it and each of its ancestors is its parent's first passing child (an
  ancestor matrix, no walk). The walk ends at the deepest node on it; the token is drawn there
  from p with that row's residual points written over (inverse CDF,
  batched_acceptance.inverse_cdf).
About 20 operations per child slot and 60 more whatever the trees' size; a batch of greedy
rows only skips the residuals (the argmax decides).

Draws: node i's test uses uniform i of its row and the final draw uniform n, so a tree of n
nodes takes n + 1 uniforms from its request's own generator (`row_uniforms`) — a number set by
its shape alone, each used at most once — and a row's draws never depend on its neighbours.
Any number of children per node is taken (the draft's trees have at most TREE_WIDTH; one from
the wire may have more): the batch pads to its widest node. A tree whose q needs more than
MAX_POINTS points at one row (children × (q width + 1): q rows near a vocabulary wide) is not
taken (`fits_on_device`): the caller decides it on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from specdec.maths.draft_q import DraftQ
from specdec.maths.tree import TokenTree
from specdec.maths.batched_acceptance import inverse_cdf

MAX_POINTS = 512  # the most residual points a logits row may keep: its children × (their q width + 1)


@dataclass(frozen=True)
class TreeLayout:
    """The batch's trees and their q as padded tensors (host-built, then moved to the device)."""

    tokens: torch.Tensor      # [R, N] int64: each node's token, padded with 0
    parent_row: torch.Tensor  # [R, N] int64: its parent's logits row (0 the root, j node j − 1); padding 0
    valid: torch.Tensor       # [R, N] bool: a real node, not padding
    ancestors: torch.Tensor   # [R, N, N] bool: [i, j] node j is node i or one of its ancestors
    children: torch.Tensor    # [R, N+1, C] int64: per logits row its children in order, -1 padding
    node_ids: torch.Tensor    # [R, N, K+1] int64: each node's token, then its q's ids, padded with the token
    node_probs: torch.Tensor  # [R, N, K+1] float32: 0, then q's probabilities, padded with 0 (greedy: all 0)
    sizes: torch.Tensor       # [R] int64: each tree's n (its final draw's uniform)
    depth: int                # the deepest node's depth (the longest path)

    def to(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "TreeLayout":
        """Every tensor moved by `move` (e.g. a non-blocking copy to the device)."""
        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self) if f.name != "depth"})


@dataclass(frozen=True)
class TreeBatch:
    """One verification batch of trees on the device."""

    target_probs: torch.Tensor  # [R, N+1, vocab] float32: p per logits row (greedy rows: one-hot on the argmax)
    layout: TreeLayout          # the trees, on the same device
    greedy: torch.Tensor        # [R] bool: the row decides by argmax (q unused)
    uniforms: torch.Tensor      # [R, N+1] float32 in [0, 1): node i's test at i, the final draw at n
    sampled: bool = True        # on the host: some row samples (all greedy: no residual is computed)


@dataclass(frozen=True)
class TreeDecisions:
    """What the target decided for each tree, still on the device."""

    path: torch.Tensor        # [R, D] int64: the accepted nodes, root's child first, -1 after the last
    next_token: torch.Tensor  # [R] int64: the recovered or bonus token
    is_bonus: torch.Tensor    # [R] bool: the walk ended at a node without children
    tested: torch.Tensor      # [R] int64: children tested, accepted ones included (greedy: every child of
                              # the root and of each accepted node, as tree_acceptance.py counts them)

    def to_host(self) -> list[tuple[list[int], int, bool, int]]:
        """(path, next token, is_bonus, tested) per row: the batch's one host synchronisation."""
        columns = torch.stack([self.next_token, self.is_bonus.long(), self.tested], dim=1)  # [R, 3]
        both = torch.cat([columns, self.path], dim=1).tolist()  # [R, 3 + D]
        return [([node for node in row[3:] if node >= 0], row[0], bool(row[1]), row[2]) for row in both]


def fits_on_device(tree: TokenTree, q: DraftQ | None) -> bool:
    """Whether decide_trees takes this tree (module docstring: at most MAX_POINTS per row)."""
    width = max((ids.shape[0] for ids in q.ids), default=0) if q is not None else 0
    return max(len(under) for under in tree.children()) * (width + 1) <= MAX_POINTS


def tree_layout(trees: Sequence[TokenTree], qs: Sequence[DraftQ | None]) -> TreeLayout:
    """The padded layout of `trees` and their q (None: a greedy row's, none) on the host, q's
    tensors copied in place (never read back as numbers)."""
    kids = [tree.children() for tree in trees]
    nodes = max(len(tree) for tree in trees)
    width = max(len(under) for per_tree in kids for under in per_tree)
    tokens, parent_row, valid, ancestors, children = [], [], [], [], []
    for tree, rows_kids in zip(trees, kids):
        n, missing = len(tree), nodes - len(tree)
        tokens.append(list(tree.tokens) + [0] * missing)
        parent_row.append(list(tree.parents) + [0] * missing)
        valid.append([True] * n + [False] * missing)
        ancestors.append(_ancestors(tree, nodes))
        children.append([under + [-1] * (width - len(under)) for under in rows_kids] + [[-1] * width] * missing)
    token_ids = torch.tensor(tokens)  # [R, N]
    node_ids, node_probs = _node_q(qs, token_ids)
    return TreeLayout(token_ids, torch.tensor(parent_row), torch.tensor(valid), torch.tensor(ancestors),
                      torch.tensor(children), node_ids, node_probs, torch.tensor([len(tree) for tree in trees]),
                      max(max(tree.depths()) for tree in trees))


def _node_q(qs: Sequence[DraftQ | None], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, N, K+1] ids, [R, N, K+1] probs): each node's token (probability 0), then its q, padded
    with its token (probability 0); q's rows copied in one write, never read as numbers."""
    where = [(r, node) for r, q in enumerate(qs) if q is not None for node in range(len(q))]
    rows_ids = [ids for q in qs if q is not None for ids in q.ids]
    rows_probs = [probs for q in qs if q is not None for probs in q.probs]
    width = max((ids.shape[0] for ids in rows_ids), default=0)
    node_ids = torch.full((*tokens.shape, width + 1), -1, dtype=torch.long)  # [R, N, K+1]
    node_probs = torch.zeros((*tokens.shape, width + 1))  # [R, N, K+1]
    if where:
        at = torch.tensor(where).T  # [2, M]
        node_ids[at[0], at[1], 1:] = pad_sequence(rows_ids, batch_first=True, padding_value=-1)  # [M, K]
        node_probs[at[0], at[1], 1:] = pad_sequence(rows_probs, batch_first=True).float()  # [M, K]
    return torch.where(node_ids < 0, tokens[..., None], node_ids), node_probs


def _ancestors(tree: TokenTree, nodes: int) -> list[list[bool]]:
    """[nodes][nodes]: [i][j] node j is node i or one of its ancestors (padded with False)."""
    out = [[False] * nodes for _ in range(nodes)]
    for node, parent in enumerate(tree.parents):
        if parent:
            out[node][:] = out[parent - 1]
        out[node][node] = True
    return out


def decide_trees(batch: TreeBatch) -> TreeDecisions:
    """Every row's walk down its tree at once (module docstring)."""
    p, layout = batch.target_probs, batch.layout
    rows, nodes = layout.tokens.shape
    at = torch.arange(rows, device=p.device)[:, None]  # [R, 1]
    node_ids = torch.arange(nodes, device=p.device)[None, :]  # [1, N]
    argmax = p.argmax(dim=-1)  # [R, N+1]
    passes = layout.tokens == argmax.gather(1, layout.parent_row)  # [R, N]: greedy
    if batch.sampled:
        segments = layout.children.clamp(min=0)  # [R, N+1, C]
        seg_ids, seg_probs = layout.node_ids[at[..., None], segments], layout.node_probs[at[..., None], segments]
        ratio, residual = _node_ratios(p, seg_ids, seg_probs, layout.children >= 0)  # [R, N+1, C], [R, N+1, W]
        ratio = torch.zeros_like(passes, dtype=p.dtype).scatter_add_(1, segments.flatten(1), ratio.flatten(1))
        passes = torch.where(batch.greedy[:, None], passes, batch.uniforms[:, :nodes] < ratio)  # [R, N]
    passes &= layout.valid
    # each row's first passing child (N: none), and the nodes on the path it leads down
    first = torch.full((rows, nodes + 1), nodes, dtype=torch.long, device=p.device)  # [R, N+1]
    first.scatter_reduce_(1, layout.parent_row, torch.where(passes, node_ids, nodes), "amin")
    first_of_parent = first.gather(1, layout.parent_row)  # [R, N]
    on_path = ~(layout.ancestors & (first_of_parent != node_ids)[:, None, :]).any(dim=-1) & layout.valid  # [R, N]
    ends = torch.where(on_path, node_ids + 1, 0).max(dim=1, keepdim=True).values  # [R, 1]: the logits row it ends at
    path = torch.where(on_path, node_ids, nodes).sort(dim=1).values[:, :layout.depth]  # [R, D], ancestors first
    # children tested: those of the root and of each path node, up to the accepted one (greedy: all)
    reached = torch.cat([torch.ones_like(on_path[:, :1]), on_path], dim=1).gather(1, layout.parent_row)  # [R, N]
    tested = reached & layout.valid & (batch.greedy[:, None] | (node_ids <= first_of_parent))
    next_token = argmax.gather(1, ends).squeeze(1)  # [R]: greedy
    if batch.sampled:
        points = seg_ids.flatten(2)  # [R, N+1, W]
        dist = p[at, ends].squeeze(1).scatter(1, points[at, ends].squeeze(1), residual[at, ends].squeeze(1))
        drawn = inverse_cdf(dist, batch.uniforms.gather(1, layout.sizes[:, None]).squeeze(1))  # [R]
        next_token = torch.where(batch.greedy, next_token, drawn)
    return TreeDecisions(torch.where(path < nodes, path, -1), next_token,
                         layout.children[at, ends, 0].squeeze(1) < 0, tested.sum(dim=1))


def _node_ratios(p: torch.Tensor, seg_ids: torch.Tensor, seg_probs: torch.Tensor,
                 real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logits row and child slot j, min(1, rⱼ(xⱼ)/qⱼ(xⱼ)) with rⱼ the row's residual after
    the earlier children's rejections ([R, N+1, C], 0 where no child), and each row's residual
    after all its children are rejected, at its points, unnormalised like p elsewhere
    ([R, N+1, W]). One step per slot, all rows together. seg_ids, seg_probs [R, N+1, C, K+1]:
    each child's segment of the points (its token first, then its q's ids) and its q there;
    real [R, N+1, C]. A token repeated among the points is kept at its first place only."""
    segment = seg_ids.shape[-1]  # K + 1
    tiny = torch.finfo(p.dtype).tiny
    points = seg_ids.flatten(2)  # [R, N+1, W = C·(K+1)]
    canon = _first_places(points)  # [R, N+1, W]
    once = canon == torch.arange(points.shape[-1], device=p.device)  # [R, N+1, W]
    q = torch.zeros((*seg_ids.shape[:3], points.shape[-1]), device=p.device)  # [R, N+1, C, W]
    q.scatter_add_(3, canon.view(seg_ids.shape), seg_probs)  # each child's q at the points' first places
    at_token = canon[..., 0::segment]  # [R, N+1, C]: where each child's token is kept
    q_of_token = ((seg_ids[..., 1:] == seg_ids[..., :1]) * seg_probs[..., 1:]).sum(dim=-1)  # [R, N+1, C]
    residual = p.gather(2, points)  # [R, N+1, W]: unnormalised rⱼ at the points, r₁ = p
    total = torch.ones_like(residual[..., 0])  # [R, N+1]: its mass (p as given)
    # p off the points: its mass, and whether it has any (exactly, as the host's sum of a residual is 0)
    elsewhere = torch.clamp(p.sum(dim=-1) - (residual * once).sum(dim=-1), min=0.0)  # [R, N+1]
    any_elsewhere = (p > 0).sum(dim=-1) > ((residual > 0) & once).sum(dim=-1)  # [R, N+1]
    ratios = []
    for slot in range(seg_ids.shape[2]):
        r_x = residual.gather(2, at_token[..., slot:slot + 1]).squeeze(-1) / total.clamp_min(tiny)  # [R, N+1]
        ratios.append(torch.clamp(r_x / q_of_token[..., slot].clamp_min(tiny), max=1.0))
        rest = torch.clamp(residual - total[..., None] * q[..., slot, :], min=0.0) * once  # [R, N+1, W]
        moved = real[..., slot] & (any_elsewhere | (rest > 0).any(dim=-1))  # the host keeps rⱼ where the rest is empty
        residual = torch.where(moved[..., None], rest, residual)
        total = torch.where(moved, elsewhere + rest.sum(dim=-1), total)
    return torch.stack(ratios, dim=-1) * real, residual.gather(2, canon)  # every place of a token its value


def _first_places(points: torch.Tensor) -> torch.Tensor:
    """[..., W] int64: for each place in a row of points, the first place of its token."""
    ordered, order = points.sort(dim=-1, stable=True)  # equal tokens together, in their order
    width = torch.arange(points.shape[-1], device=points.device).expand_as(order)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    start = torch.where(starts, width, 0).cummax(dim=-1).values  # [..., W]: where each run of a token starts
    return torch.empty_like(order).scatter_(-1, order, order.gather(-1, start))
