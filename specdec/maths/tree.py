"""Token trees: several continuations proposed in one round, verified in one target forward.

A tree's nodes are listed parents first. Each node's parent is given as on the wire: 0 is the
root (the session's last committed token, whose logits score the first depth) and j > 0 is node
j − 1; so a chain of γ tokens has parents 0, 1, …, γ − 1. In a forward, node i sits at the
position of the root + its depth and attends to the history and to its own ancestors only
(`specdec/runtime/batch_cache.ancestor_mask`); rows of the verification's logits are the
root's, then one per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specdec.errors import InvalidArgument

TREE_WIDTH = 4  # the most nodes the draft keeps at a depth (so the most children of a node)


@dataclass(frozen=True)
class TokenTree:
    """The tokens of a round's proposal and how they hang together."""

    tokens: tuple[int, ...]   # per node, its token (following its parent's)
    parents: tuple[int, ...]  # per node, its parent: 0 = the root, j = node j − 1 (so parents[i] <= i)

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> "TokenTree":
        return cls(tuple(tokens), tuple(range(len(tokens))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(len(self.parents)))

    def check(self) -> None:
        """InvalidArgument naming the first node that breaks the format."""
        if len(self.parents) != len(self.tokens):
            raise InvalidArgument(f"a tree of {len(self.tokens)} tokens needs {len(self.tokens)} parents, "
                                  f"got {len(self.parents)}")
        for i, parent in enumerate(self.parents):
            if not 0 <= parent <= i:
                raise InvalidArgument(f"draft_parents[{i}] is {parent}: a node's parent is 0 (the root) or an "
                                      f"earlier node 1..{i} (node j is j − 1 counted from 0)")
        seen: set[tuple[int, int]] = set()
        for i, key in enumerate(zip(self.parents, self.tokens)):
            if key in seen:
                raise InvalidArgument(f"draft node {i} repeats token {key[1]} under the same parent")
            seen.add(key)

    def depths(self) -> list[int]:
        """Per node, its depth: 1 for a child of the root."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent == 0 else out[parent - 1] + 1)
        return out

    def children(self) -> list[list[int]]:
        """Per row (0 = the root, j = node j − 1), the nodes under it, in order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent].append(i)
        return out

    def spine(self) -> list[int]:
        """The nodes from the root down its first children: the draft lists each node's likeliest
        child first, so this is its own chain (what a chain round would have proposed)."""
        first = self.children()
        out: list[int] = []
        row = 0
        while first[row]:
            out.append(first[row][0])
            row = out[-1] + 1
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node] - 1
        return out[::-1]


def graft(tree: TokenTree, path: Sequence[int], max_nodes: int) -> TokenTree:
    """`tree` with the chain `path` hung from the root: it goes down the nodes whose tokens it
    repeats and adds the rest, in order, after the tree's own nodes, while the tree has fewer
    than `max_nodes` nodes. The tree's nodes keep their numbers and their first children (only
    a leaf may gain a grafted first child)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    children = tree.children()
    row = 0  # the root
    for token in path:
        match = next((node for node in children[row] if tokens[node] == token), None)
        if match is None:
            if len(tokens) >= max_nodes:
                break
            match = len(tokens)
            tokens.append(token)
            parents.append(row)
            children[row].append(match)
            children.append([])
        row = match + 1
    return TokenTree(tuple(tokens), tuple(parents))


def subtree(tree: TokenTree, keep: list[int]) -> TokenTree:
    """The tree of the nodes `keep` (ascending, each one's parent kept too), renumbered."""
    index = {node: new for new, node in enumerate(keep)}
    return TokenTree(tuple(tree.tokens[i] for i in keep),
                     tuple(0 if tree.parents[i] == 0 else index[tree.parents[i] - 1] + 1 for i in keep))


@dataclass(frozen=True)
class TreeOutcome:
    """What the target did with a tree, as the policy and the stats count it."""

    spine_proposed: int       # nodes on the draft's own chain (the tree's spine)
    spine_accepted: int       # of them, accepted before the accepted path left the spine (or ended)
    alternatives_tried: int   # alternatives beside the first rejected spine node the target tested
    alternatives_accepted: int  # of them, accepted (0 or 1: the path goes on under it)


def tree_outcome(tree: TokenTree, accepted_nodes: tuple[int, ...] | list[int],
                 draft_nodes: int | None = None) -> TreeOutcome:
    """How the accepted path (nodes, root's child first) went against the tree's spine: how far
    it followed the spine and, where the spine's node was rejected, how many of that node's
    siblings (in order, as the target tests them) were tried and whether one was accepted.
    Only the draft's own nodes count as alternatives: those from `draft_nodes` on were grafted
    onto its tree (prompt lookup's branch, `graft`), and a path through them took none."""
    own = len(tree) if draft_nodes is None else draft_nodes
    spine = [node for node in tree.spine() if node < own]  # a grafted node ends it
    on = 0
    while on < len(accepted_nodes) and on < len(spine) and accepted_nodes[on] == spine[on]:
        on += 1
    if on == len(spine):
        return TreeOutcome(len(spine), on, 0, 0)
    siblings = [node for node in tree.children()[0 if on == 0 else spine[on - 1] + 1][1:]  # after it
                if node < own]
    if on < len(accepted_nodes) and accepted_nodes[on] < own:  # on through an alternative
        return TreeOutcome(len(spine), on, siblings.index(accepted_nodes[on]) + 1, 1)
    return TreeOutcome(len(spine), on, len(siblings), 0)
