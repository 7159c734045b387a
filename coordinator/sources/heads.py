"""The target's Medusa-style heads as a proposal source: no model call of its own.

A target serving heads (ModelInfo.num_heads > 0) returns with a Verify that asks for them
(VerifyRequest.head_candidates) each head's most likely tokens, read at the position that chose
the round's next token: head d guesses the token d positions past it. They are proposals for the
next round only. This source keeps, per running request's session, those of the latest verdict
with the length of the history they continue; a round that starts from another length (a
round whose Verify asked for none, a new request) has none at hand.

A heads round proposes them as a token tree (`heads_tree`): depth d takes head d's candidates,
nodes by path score (the product of the heads' probabilities along the path), so every node's
children are picked by rank — deterministic given the history — and q is one-hot: the target's
tree walk is exact at any temperature (docs/design.md, Over a token tree). Heads only propose:
the output is the target's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from specdec.maths.tree import TokenTree
from specdec.types import Proposal, Proposer, SparseDist

from coordinator.rounds import Drafts, Round, RoundResult
from coordinator.sources.base import ProposalSource, one_hot_dists

MAX_HEAD_CANDIDATES = 32  # VerifyRequest.head_candidates' limit (specdec/runtime/heads.py, which needs torch)


def heads_tree(heads: Sequence[SparseDist], max_nodes: int, max_depth: int) -> TokenTree:
    """The tree of at most `max_nodes` nodes, at most `max_depth` deep, with the highest path
    scores: node at depth d holds one of head d's candidates (`heads[d - 1]`, most likely
    first), its path score the product of its path's probabilities. Grown best first, so a node
    is listed after its parent (a child's score is at most its parent's) and a node's children
    in rank order (its first child is head d + 1's likeliest: the tree's spine is the heads'
    top tokens). Candidates of probability 0 are left out."""
    depth_cap = min(max_depth, len(heads))
    tokens: list[int] = []
    parents: list[int] = []
    frontier: list[tuple[float, int, int, int, int]] = []  # (-score, order, depth, parent row, token)
    order = 0

    def offer(score: float, depth: int, row: int) -> None:
        nonlocal order
        if depth > depth_cap:
            return
        dist = heads[depth - 1]
        for token, prob in zip(dist.token_ids, dist.probs):
            if prob > 0:
                heapq.heappush(frontier, (-score * prob, order, depth, row, int(token)))
                order += 1

    offer(1.0, 1, 0)
    while frontier and len(tokens) < max_nodes:
        negative, _, depth, row, token = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(row)
        offer(-negative, depth + 1, len(tokens))  # its row: node len(tokens) - 1, as on the wire
    return TokenTree(tuple(tokens), tuple(parents))


@dataclass(frozen=True)
class HeadProposals:
    """The heads' proposals of one verdict."""

    base: int                        # committed tokens of the round they are for
    heads: tuple[SparseDist, ...]    # per head, head 1 first, its top candidates


class TargetHeads(ProposalSource):
    proposer = Proposer.HEADS

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

    async def propose(self, rnd: Round) -> Drafts:
        heads = self.at_hand(rnd.run.record.session_id, rnd.base)
        tree = heads_tree(heads, rnd.plan.tree_nodes or rnd.plan.gamma, min(rnd.plan.gamma, rnd.cap))
        if not len(tree):
            return Drafts()
        tokens = list(tree.tokens)
        parents = () if tree.is_chain else tree.parents  # a chain goes as one (a target that verifies chains only)
        return Drafts(Proposal(tokens, one_hot_dists(tokens), parents=parents), Proposer.HEADS)

    def committed(self, session_id: str, result: RoundResult) -> None:
        verdict = result.verdict
        if verdict.head_proposals:
            self._latest[session_id] = HeadProposals(result.base + len(verdict.committed(result.drafts)),
                                                     tuple(verdict.head_proposals))
        else:
            self._latest.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        self._latest.pop(session_id, None)
