"""The target's Medusa-style heads as a proposal source: no model call of its own.

A target serving heads (ModelInfo.num_heads > 0) returns with a Verify that asks for them
(VerifyRequest.head_candidates) each head's most likely tokens, read at the position that chose
the round's next token: head d guesses the token d positions past it. They are proposals for the
next round only. This source keeps, per running request's session, those of the latest verdict
with the length of the history they continue; a round that starts from another length (a
round whose Verify asked for none, a new request) has none at hand.

A heads round proposes them as a token tree (`heads_tree`): depth d takes head d's candidates,
the spine (each head's likeliest) and then the nodes of the highest path score (the product of
the heads' probabilities along the path), so every node's children are picked by rank —
deterministic given the history — and q is one-hot: the target's tree walk is exact at any
temperature (docs/design.md, Over a token tree). Heads only propose:
the output is the target's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from specdec.maths.tree import TokenTree
from specdec.types import MAX_HEAD_CANDIDATES, ModelDescription, Proposal, Source, SparseDist

from coordinator.policy.heads_estimates import HeadsAtHand
from coordinator.rounds import Drafts, Round, RoundResult
from coordinator.sources.base import ProposalSource, one_hot_dists


def heads_tree(heads: Sequence[SparseDist], max_nodes: int, max_depth: int) -> TokenTree:
    """The tree of at most `max_nodes` nodes, at most `max_depth` deep, from the heads'
    candidates (`heads[d - 1]`: head d's, most likely first): a node at depth d holds one of head
    d's candidates and its path score is the product of its path's probabilities. It holds the
    spine — each head's likeliest token, as deep as the nodes allow: what the planner prices
    (heads_estimates.py) — and then the other nodes with the highest path scores, grown best
    first, so a node comes with its parent (a child's score is at most its parent's). Listed
    parents first (by depth) and each node's children by rank, so the spine is every node's
    first child from the root. Candidates of probability 0 are left out. The nodes are picked
    from the heads' numbers only: deterministic given the history (q one-hot)."""
    deepest = min(max_depth, len(heads))
    chosen: set[tuple[int, ...]] = set()  # a node as the ranks of the candidates on its path
    spine: tuple[int, ...] = ()
    for dist in heads[:min(deepest, max_nodes)]:
        if not dist.probs or dist.probs[0] <= 0:
            break
        spine += (0,)
        chosen.add(spine)
    frontier: list[tuple[float, int, tuple[int, ...]]] = []  # (-score, order, node)
    order = 0

    def offer(node: tuple[int, ...], score: float) -> None:
        nonlocal order
        if len(node) >= deepest:
            return
        for rank, prob in enumerate(heads[len(node)].probs):
            child = node + (rank,)
            if prob > 0 and child not in chosen:
                heapq.heappush(frontier, (-score * prob, order, child))
                order += 1

    score = 1.0
    offer((), score)
    for depth in range(1, len(spine) + 1):
        score *= heads[depth - 1].probs[0]
        offer(spine[:depth], score)
    while frontier and len(chosen) < max_nodes:
        negative, _, node = heapq.heappop(frontier)
        chosen.add(node)
        offer(node, -negative)
    listed = sorted(chosen, key=lambda node: (len(node), node))  # by depth, then the ranks on the path
    row = {node: i + 1 for i, node in enumerate(listed)}  # as on the wire: node i is row i + 1
    tokens = tuple(int(heads[len(node) - 1].token_ids[node[-1]]) for node in listed)
    return TokenTree(tokens, tuple(row.get(node[:-1], 0) for node in listed))


@dataclass(frozen=True)
class HeadProposals:
    """The heads' proposals of one verdict."""

    base: int                        # committed tokens of the round they are for
    heads: tuple[SparseDist, ...]    # per head, head 1 first, its top candidates


class HeadsSource(ProposalSource):
    kind = Source.HEADS

    def __init__(self, candidates: int) -> None:
        if not 0 <= candidates <= MAX_HEAD_CANDIDATES:
            raise ValueError(f"--head-candidates must be in [0, {MAX_HEAD_CANDIDATES}] (0: never ask the "
                             f"target's heads), got {candidates}")
        self.candidates = candidates  # --head-candidates: what a Verify of a request that may use heads asks for
        self._latest: dict[str, HeadProposals] = {}  # per running request's session

    def at_hand(self, session_id: str, base: int) -> tuple[SparseDist, ...]:
        """The heads' proposals for a round that starts with `base` committed tokens (none: ())."""
        latest = self._latest.get(session_id)
        return latest.heads if latest is not None and latest.base == base else ()

    def depth_at(self, session_id: str, base: int) -> int:
        """How deep a tree of the proposals at hand goes (0: none): heads up to the first without
        candidates."""
        depth = 0
        for dist in self.at_hand(session_id, base):
            if not dist.token_ids:
                break
            depth += 1
        return depth

    def offer(self, session_id: str, base: int, target: ModelDescription,
              max_gamma: int) -> tuple[HeadsAtHand, HeadsAtHand | None]:
        """What the heads of `target` (a replica that serves them) offer the session's round that
        starts with `base` committed tokens: what a round of their proposals could be, and the
        proposals the round before read (None: none at hand)."""
        limit = min(max_gamma, target.max_speculative_tokens)
        served = HeadsAtHand(min(target.num_heads, limit), limit, self.candidates, trees=target.verifies_trees)
        depth = min(self.depth_at(session_id, base), limit)
        if not depth:
            return served, None
        width = max(len(dist.token_ids) for dist in self.at_hand(session_id, base)[:depth])
        return served, HeadsAtHand(depth, limit, width, trees=target.verifies_trees)

    async def propose(self, rnd: Round) -> Drafts:
        heads = self.at_hand(rnd.run.record.session_id, rnd.base)
        tree = heads_tree(heads, rnd.plan.tree_nodes or rnd.plan.gamma, min(rnd.plan.gamma, rnd.cap))
        if not len(tree):
            return Drafts()
        tokens = list(tree.tokens)
        parents = () if tree.is_chain else tree.parents  # a chain goes as one (a target that verifies chains only)
        return Drafts(Proposal(tokens, one_hot_dists(tokens), parents=parents), Source.HEADS)

    def committed(self, session_id: str, result: RoundResult) -> None:
        verdict = result.verdict
        if verdict.head_proposals:
            self._latest[session_id] = HeadProposals(result.base + len(verdict.committed(result.drafts)),
                                                     tuple(verdict.head_proposals))
        else:
            self._latest.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        self._latest.pop(session_id, None)
