"""Verification: one forward pass over new tokens + drafts, then the acceptance step; with a
target's heads, their proposals for the next round read in the same pass."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from specdec.maths.acceptance import accept_greedy, accept_sampled
from specdec.maths.draft_q import DraftQ
from specdec.errors import InvalidArgument
from specdec.maths.logprobs import token_logprobs
from specdec.runtime.engine import VerifyCall
from specdec.runtime.generators import make_generator
from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.session_kv import Row, SessionKV
from specdec.maths.sampling import target_probs
from specdec.maths.tree import TokenTree
from specdec.maths.tree_acceptance import accept_tree_greedy, accept_tree_sampled
from specdec.types import MAX_HEAD_CANDIDATES, SamplingParams, SparseDist, TokenLogprobs, Verdict, check_top_logprobs

log = logging.getLogger(__name__)


class HostVerification:
    """Verification as host code over the engine's forward_batch: validate, forward, accept."""

    def __init__(self, engine: SessionKV):
        self.engine = engine

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int],
             drafts: list[int], draft_probs: list[SparseDist], params: SamplingParams, seed: int,
             cache_salt: str = "", top_logprobs: int | None = None,
             draft_parents: Sequence[int] = (), head_candidates: int = 0) -> VerifyCall:
        """Validate a request without touching any cache (InvalidArgument naming what is wrong).
        head_candidates on a target without heads asks for nothing (the call gets 0)."""
        engine = self.engine
        if not 0 <= head_candidates <= MAX_HEAD_CANDIDATES:
            raise InvalidArgument(f"head_candidates must be in 0..{MAX_HEAD_CANDIDATES}, got {head_candidates}")
        if engine.heads is None:
            head_candidates = 0
        gamma = len(drafts)
        if gamma > engine.description.max_speculative_tokens:
            raise InvalidArgument(
                f"{gamma} draft tokens exceed this service's limit of "
                f"{engine.description.max_speculative_tokens}"
            )
        tree = None
        if draft_parents:
            tree = TokenTree(tuple(drafts), tuple(draft_parents))
            tree.check()
            if tree.is_chain:
                tree = None
            elif not engine.verifies_trees:
                raise InvalidArgument("this target service verifies chains only (its engine cannot mask a "
                                      "tree): send draft_parents empty (see ModelInfo.verifies_trees)")
        # a tree's nodes sit at the root's position plus their depth: it reaches only as far
        # into the context as it is deep, however many nodes it has
        engine.check_request(session_id, prefix_len, new_tokens, gamma if tree is None else max(tree.depths()))
        engine.check_token_ids(drafts, "draft_tokens")
        check_top_logprobs(top_logprobs)
        draft_q = None
        if not params.greedy and gamma:
            # on the host: this runs on the event loop, where a copy to a GPU would wait for the
            # forward running on the model thread; _accept moves it there without blocking
            draft_q = DraftQ.from_sparse(draft_probs, drafts, engine.vocab_size)
        return VerifyCall(session_id, prefix_len, prefix_hash, new_tokens, drafts, draft_q, params, seed,
                          cache_salt, top_logprobs, tree, head_candidates)

    def verify_batch(self, calls: Sequence[VerifyCall]) -> list[Verdict | Exception]:
        """Run on the model worker: roll each session back, ONE forward over every row's new
        tokens + drafts, then each row's acceptance step with its own generator; crop each
        session after its last accepted draft; the heads' proposals of the calls that ask for
        them. Calls are of distinct sessions. A row's failure (cache miss, bad q) is its own
        result; a failed forward is the result of every row in it."""
        engine = self.engine
        results: list[Verdict | Exception | None] = [None] * len(calls)
        started: list[tuple[int, SessionCache]] = []  # (index, the session's cache)
        rows: list[Row] = []
        for index, call in enumerate(calls):
            try:
                entry, feed = engine.begin(call.session_id, call.prefix_len, call.prefix_hash, call.new_tokens,
                                           call.cache_salt)
            except Exception as exc:  # noqa: BLE001 - this row's error, not the batch's
                results[index] = exc
                continue
            started.append((index, entry))
            rows.append(Row(call.session_id, entry, list(feed) + call.drafts, len(call.drafts) + 1, call.tree))
        hidden: list = []  # per row [γ+1, hidden] when a call asks for the heads' proposals
        try:
            if any(calls[index].head_candidates for index, _ in started):
                logits, hidden = engine.forward_hidden(rows)  # per row [γ+1, vocab], [γ+1, hidden]
            else:
                logits = engine.forward_batch(rows) if rows else []  # per row [γ+1, vocab]
        except Exception as exc:  # noqa: BLE001 - every row of the forward failed with it
            logits = [exc] * len(rows)
        forwarded: list[tuple[int, SessionCache, torch.Tensor]] = []
        for (index, entry), row_logits in zip(started, logits):
            if isinstance(row_logits, Exception):
                results[index] = row_logits
            else:
                forwarded.append((index, entry, row_logits))
        verdicts = self.accept_rows([(calls[index], entry, row_logits) for index, entry, row_logits in forwarded])
        for (index, entry, _), verdict in zip(forwarded, verdicts):
            results[index] = verdict
            if not isinstance(verdict, Exception):
                call = calls[index]
                engine.keep_committed(entry, call.prefix_len + len(call.new_tokens), call.cache_salt)
        if hidden:
            at_row = {index: row for row, (index, _) in enumerate(started)}
            self._add_head_proposals(calls, results, {index: hidden[at_row[index]] for index, _, _ in forwarded})
        engine.finish([call.session_id for call in calls])
        return results

    def _add_head_proposals(self, calls: Sequence[VerifyCall], results: list, hidden: dict[int, torch.Tensor]) -> None:
        """The heads' proposals of every verified call that asks for them, in one pass of the heads:
        each read at the hidden state whose logits chose its next token (hidden: per call index
        [γ+1, hidden], the rows of its logits). Proposals never change a verdict: should the heads
        fail, the verdicts go without them."""
        asking = [index for index, state in hidden.items()
                  if calls[index].head_candidates and isinstance(results[index], Verdict)]
        if not asking:
            return
        try:
            states = torch.stack([hidden[index][chose_next_token(results[index])] for index in asking])  # [n, hidden]
            proposals = self.engine.heads.proposals(states, [calls[index].head_candidates for index in asking])
        except Exception:  # noqa: BLE001 - the verdicts stand; the next rounds propose otherwise
            log.exception("the heads' proposals failed; %d verdict(s) go without them", len(asking))
            return
        for index, proposal in zip(asking, proposals):
            results[index] = dataclasses.replace(results[index], head_proposals=proposal)

    def accept_rows(self, rows: Sequence[tuple[VerifyCall, SessionCache, torch.Tensor]]) -> list[Verdict | Exception]:
        """The acceptance step of each forwarded row (its call, cache and logits [γ+1, vocab]),
        one row at a time; a row's failure is its own result. An engine may decide them
        together (device_verification.py)."""
        verdicts: list[Verdict | Exception] = []
        for call, entry, logits in rows:
            try:
                verdicts.append(self._accept(call, entry, logits))
            except Exception as exc:  # noqa: BLE001 - this row's error
                verdicts.append(exc)
        return verdicts

    def _accept_tree(self, call: VerifyCall, tree: TokenTree, entry: SessionCache, logits: torch.Tensor) -> Verdict:
        """The acceptance step over a tree (specdec/maths/tree_acceptance.py); only the accepted path's
        K/V stay, moved to the positions after the history. logits [1 + n, vocab]."""
        if call.params.greedy:
            verdict = accept_tree_greedy(tree, logits.argmax(dim=-1).tolist())
        else:
            generator = make_generator(call.seed, self.engine.device)
            assert call.draft_q is not None  # a sampled call with drafts: call() built their q
            verdict = accept_tree_sampled(tree, call.draft_q.to(self.engine.device), target_probs(logits, call.params),
                                          generator)
        return self.tree_verdict(call, entry, logits, verdict.path, verdict.next_token, verdict.is_bonus)

    def tree_verdict(self, call: VerifyCall, entry: SessionCache, logits: torch.Tensor, path: Sequence[int],
                     token: int, is_bonus: bool) -> Verdict:
        """A tree's verdict once decided (its accepted nodes `path`, root's child first, then the
        target's `token`): only the path's K/V stay, moved to the positions after the history."""
        tree = call.tree
        assert tree is not None
        self.engine.keep_path(entry, len(entry) - len(tree), path)
        emitted = [tree.tokens[node] for node in path] + [token]
        scored_at = [0] + [node + 1 for node in path]  # the logits row of each emitted token
        return Verdict(len(path), token, is_bonus, [], len(entry), self.engine.take_restored(call.session_id),
                       self._logprobs(call, logits, emitted, scored_at), tuple(path))

    def _accept(self, call: VerifyCall, entry: SessionCache, logits: torch.Tensor) -> Verdict:
        """The acceptance step of one row. logits [γ+1, vocab]; the cache holds the fed tokens +
        the drafts and is cropped after the last accepted draft."""
        if call.tree is not None:
            return self._accept_tree(call, call.tree, entry, logits)
        if call.params.greedy:
            verdict = accept_greedy(call.drafts, logits.argmax(dim=-1).tolist())
        else:
            generator = make_generator(call.seed, self.engine.device)
            p = target_probs(logits, call.params)  # [γ+1, vocab]
            q = call.draft_q.to(p.device) if call.draft_q is not None else DraftQ.empty(p.device)
            verdict = accept_sampled(call.drafts, q, p, generator)
        return self.chain_verdict(call, entry, logits, verdict.num_accepted, verdict.next_token,
                                  verdict.accept_probs)

    def chain_verdict(self, call: VerifyCall, entry: SessionCache, logits: torch.Tensor, accepted: int,
                      token: int, accept_probs: list[float]) -> Verdict:
        """A chain's verdict once decided (its first `accepted` drafts, then the target's `token`):
        the session cropped after its accepted drafts."""
        entry.crop(len(entry) - len(call.drafts) + accepted)
        emitted = call.drafts[:accepted] + [token]
        return Verdict(accepted, token, accepted == len(call.drafts), accept_probs, len(entry),
                       self.engine.take_restored(call.session_id),
                       self._logprobs(call, logits, emitted, list(range(len(emitted)))))

    @staticmethod
    def _logprobs(call: VerifyCall, logits: torch.Tensor, emitted: list[int],
                  scored_at: list[int]) -> tuple[TokenLogprobs, ...]:
        """The emitted tokens' log-probabilities when the call asks for them; scored_at: the
        logits row of each (logits [rows, vocab])."""
        if call.top_logprobs is None:
            return ()
        return tuple(token_logprobs(logits[scored_at], emitted, call.top_logprobs))

    def release(self, session_id: str) -> bool:
        return self.engine.release(session_id)


def chose_next_token(verdict: Verdict) -> int:
    """The row of a call's logits that chose its next token: a chain's after its accepted drafts
    (num_accepted), a tree's after its last accepted node (node + 1), the root's (0) when none was."""
    if verdict.accepted_nodes:
        return verdict.accepted_nodes[-1] + 1
    return verdict.num_accepted
