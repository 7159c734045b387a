"""Proposers: return γ draft tokens and the distribution each was sampled from.

Hints (prompt lookup's candidates, sent by the coordinator) ride along in a call's first
forward: the draft checks them like a target checks drafts, against its own proposal
distribution q — greedy: a hint is kept while it is q's argmax; sampled: kept with probability
q(hint), else replaced by a draw from q without the hint, so every proposed token is still
exactly a draw from the q reported with it and the target's acceptance step stays lossless.
The kept hints cost no draft step: a round of γ steps proposes γ + (hints kept) tokens.

A call may stop early (`min_confidence`): after a token the draft itself gave less than that
probability, further tokens would mostly be rejected, so the call returns what it has (as HF's
assistant_confidence_threshold does). The rule looks at the draft's numbers only, never the
target's, so the acceptance step stays lossless; it lets a caller ask for a long γ and pay for
the draft steps only where the draft is sure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.errors import InvalidArgument
from specdec.runtime.engine import ProposeCall
from specdec.runtime.generators import make_generator
from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.session_kv import Row, SessionKV
from specdec.maths.sampling import proposal_top_k
from specdec.types import Proposal, SamplingParams, SparseDist

from specdec.runtime.tree_drafting import grow_trees


@dataclass
class ChainDraft:
    """A call while it drafts in a batch."""

    index: int
    call: ProposeCall
    entry: SessionCache
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)
    hints_kept: int = 0  # leading tokens that are hints the draft agreed with
    stopped: bool = False  # no more steps: its cache could not drop rejected hints, or it is unsure

    @property
    def done(self) -> bool:
        """γ steps drafted: each step proposes one token of its own, the kept hints come free."""
        return self.stopped or len(self.tokens) >= self.call.gamma + self.hints_kept

    def add(self, token: int, dist: SparseDist, confidence: float = 1.0) -> None:
        """Append a drafted token; one drafted with less than min_confidence ends the call."""
        self.tokens.append(token)
        self.dists.append(dist)
        if confidence < self.call.min_confidence:
            self.stopped = True


def _greedy_confidence(logits: torch.Tensor, wanted: bool) -> list[float]:
    """Per row of logits [n, vocab], the draft's probability of its argmax token (softmax at
    T = 1); all 1.0 without computing anything when no call of the rows stops early."""
    if not wanted:
        return [1.0] * logits.shape[0]
    logits = logits.float()
    return torch.exp(logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)).tolist()


class HostDrafting:
    """A small causal LM proposes autoregressively from its top-K truncated distribution."""

    def __init__(self, engine: SessionKV, proposal_top_k: int):
        self.engine = engine
        self.proposal_top_k = proposal_top_k

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], gamma: int,
             params: SamplingParams, seed: int, hints: Sequence[int] = (),
             min_confidence: float = 0.0, uncommitted: int = 0, cache_salt: str = "",
             tree_nodes: int = 0) -> ProposeCall:
        """Validate a request without touching any cache."""
        limit = self.engine.description.max_speculative_tokens
        if not 0.0 <= min_confidence < 1.0:  # (NaN fails too)
            raise InvalidArgument(f"min_confidence must be in [0, 1) (0 = off), got {min_confidence}")
        if not 1 <= gamma <= limit:
            raise InvalidArgument(f"num_speculative_tokens must be in [1, {limit}], got {gamma}")
        if gamma + len(hints) > limit:
            raise InvalidArgument(f"num_speculative_tokens + hint_tokens must be at most {limit} (the "
                                  f"most draft tokens a call may return), got {gamma} + {len(hints)}")
        if not 0 <= tree_nodes <= limit:
            raise InvalidArgument(f"tree_nodes must be in [0, {limit}] (0: a chain), got {tree_nodes}")
        if tree_nodes and hints:
            raise InvalidArgument("hint_tokens go with a chain only: send them without tree_nodes")
        if not self.engine.grows_trees:
            tree_nodes = 0  # this engine cannot grow a tree: it drafts a chain (the response has no parents)
        self.engine.check_token_ids(hints, "hint_tokens")
        self.engine.check_request(session_id, prefix_len, new_tokens, gamma - 1 + len(hints))
        if not 0 <= uncommitted <= prefix_len + len(new_tokens):
            raise InvalidArgument(f"uncommitted_tokens must be in [0, prefix_len + len(new_tokens)] = "
                                  f"[0, {prefix_len + len(new_tokens)}], got {uncommitted}")
        return ProposeCall(session_id, prefix_len, prefix_hash, new_tokens, gamma, params, seed, tuple(hints),
                           min_confidence, uncommitted, cache_salt, tree_nodes)

    def _check_hints(self, drafting: ChainDraft, logits: torch.Tensor) -> None:
        """The first step of a call with hints: logits [hints + 1, vocab], row i the draft's
        distribution after the first i hints. Keeps the leading hints the draft agrees with and
        adds its own token after them; the cache then holds the kept hints only."""
        hints, params, generator = drafting.call.hints, drafting.call.params, drafting.generator
        if params.greedy:
            argmax = logits.argmax(dim=-1).tolist()  # [hints + 1]
            kept = next((i for i, hint in enumerate(hints) if argmax[i] != hint), len(hints))
            for i in range(kept):
                drafting.add(hints[i], SparseDist.one_hot(hints[i]))
            confidence = _greedy_confidence(logits[kept:kept + 1], drafting.call.min_confidence > 0)[0]
            drafting.add(argmax[kept], SparseDist.one_hot(argmax[kept]), confidence)
        else:
            ids, probs = proposal_top_k(logits, params, self.proposal_top_k)  # [hints + 1, K]
            kept = len(hints)
            for i in range(len(hints) + 1):
                keep = probs[i] > 0
                row_ids, row_probs = ids[i][keep], probs[i][keep]  # [K']
                dist = SparseDist(tuple(row_ids.tolist()), tuple(row_probs.tolist()))
                if i < len(hints):
                    is_hint = row_ids == hints[i]
                    q_hint = float(row_probs[is_hint].sum())
                    if float(torch.rand((), generator=generator, device=generator.device)) < q_hint:
                        drafting.add(hints[i], dist)
                        continue
                    kept, row_probs = i, row_probs.masked_fill(is_hint, 0.0)  # q without the hint
                pick = int(torch.multinomial(row_probs, 1, generator=generator).item())
                drafting.add(int(row_ids[pick]), dist, float(dist.probs[pick]))
                break
        drafting.hints_kept = kept
        if not drafting.entry.crop(len(drafting.entry) - (len(hints) - kept)):  # drop the rejected hints
            # a cache that cannot crop still holds them: drop it (the next call is a miss) and
            # end this call here, so no token is drafted after the rejected hints
            self.engine.caches.discard(drafting.call.session_id, drafting.entry)
            drafting.stopped = True

    def _draw_all(self, live: Sequence[ChainDraft], logits: Sequence[torch.Tensor]) -> None:
        """One drafted token for every call: per call its token and the sparse q it was drawn
        from, appended to it. logits: per call [1, vocab]. Calls with the same sampling warp are
        warped together (top-k first: no sort of the vocabulary); each draws with its own generator."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, drafting in enumerate(live):
            groups.setdefault(drafting.call.params, []).append(i)
        for params, members in groups.items():
            stacked = torch.cat([logits[i] for i in members])  # [g, vocab]
            if params.greedy:
                confidence = _greedy_confidence(stacked, any(live[i].call.min_confidence > 0 for i in members))
                for i, token, sure in zip(members, stacked.argmax(dim=-1).tolist(), confidence):
                    live[i].add(token, SparseDist.one_hot(token), sure)
                continue
            ids, probs = proposal_top_k(stacked, params, self.proposal_top_k)  # [g, K]
            for row, i in enumerate(members):
                keep = probs[row] > 0
                row_ids, row_probs = ids[row][keep], probs[row][keep]  # [K']
                pick = int(torch.multinomial(row_probs, 1, generator=live[i].generator).item())
                dist = SparseDist(tuple(row_ids.tolist()), tuple(row_probs.tolist()))
                live[i].add(dist.token_ids[pick], dist, dist.probs[pick])

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal | Exception]:
        """Run on the model worker: roll each session back and append its new tokens in ONE
        forward, then draw step by step, one forward per step for every call still drafting
        (a call leaves when it has its γ tokens). Each call draws with its own generator; calls
        are of distinct sessions; a call's failure is its own result."""
        engine = self.engine
        results: list[Proposal | Exception | None] = [None] * len(calls)
        live: list[ChainDraft] = []
        rows: list[Row] = []
        started: list[tuple[ProposeCall, SessionCache]] = []
        trees: list[tuple[int, SessionCache, Sequence[int], ProposeCall]] = []  # calls that grow a tree
        for index, call in enumerate(calls):
            try:
                entry, feed = engine.begin(call.session_id, call.prefix_len, call.prefix_hash, call.new_tokens,
                                           call.cache_salt)
            except Exception as exc:  # noqa: BLE001 - this call's error, not the batch's
                results[index] = exc
                continue
            started.append((call, entry))
            if call.tree_nodes:
                trees.append((index, entry, feed, call))
                continue
            live.append(ChainDraft(index, call, entry, make_generator(call.seed, engine.device)))
            rows.append(Row(call.session_id, entry, [*feed, *call.hints], 1 + len(call.hints)))
        self.draft_chains(live, rows, results)
        if trees:
            self.grow_trees(trees, results)
        for call, entry in started:  # its history is committed; a call made ahead's last ones are not
            engine.keep_committed(entry, call.prefix_len + len(call.new_tokens) - call.uncommitted, call.cache_salt)
        engine.finish([call.session_id for call in calls])
        return results

    def draft_chains(self, live: list[ChainDraft], rows: list[Row], results: list) -> None:
        """The chains' drafting: ONE forward of every call's new tokens (and hints), then one
        forward per step for every call still drafting (a call leaves when it has its γ tokens);
        each call's Proposal, or its error, goes to results[its index]. An engine with a
        better loop overrides this (the graph engine's on the device, device_drafting.py)."""
        engine = self.engine
        while live:
            try:
                logits = engine.forward_batch(rows)  # per row [keep_logits, vocab]
            except Exception as exc:  # noqa: BLE001 - every call in the forward failed with it
                for drafting in live:
                    results[drafting.index] = exc
                break
            try:
                plain: list[int] = []
                for i, row in enumerate(rows):
                    if row.keep_logits > 1:  # a first step with hints
                        self._check_hints(live[i], logits[i])
                    else:
                        plain.append(i)
                self._draw_all([live[i] for i in plain], [logits[i] for i in plain])
            except Exception as exc:  # noqa: BLE001 - a bug: the calls drafting now fail with it
                for drafting in live:
                    results[drafting.index] = exc
                break
            still: list[ChainDraft] = []
            for drafting in live:
                if not drafting.done:
                    still.append(drafting)
                else:
                    results[drafting.index] = self.proposal(drafting)
            live = still
            rows = [Row(d.call.session_id, d.entry, d.tokens[-1:], 1) for d in live]

    def grow_trees(self, trees: list[tuple[int, SessionCache, Sequence[int], ProposeCall]], results: list) -> None:
        """The trees' drafting (tree_drafting.py): one forward per depth for every tree, each
        depth picked on the host call by call. An engine with a better one overrides this (the
        graph engine's, every tree of a depth at once on the device, device_drafting.py)."""
        grow_trees(self.engine, trees, results)

    def proposal(self, drafting: ChainDraft) -> Proposal:
        """A call's answer once it has drafted."""
        return Proposal(drafting.tokens, drafting.dists, len(drafting.entry), drafting.hints_kept,
                        self.engine.take_restored(drafting.call.session_id))

    def release(self, session_id: str) -> bool:
        return self.engine.release(session_id)
