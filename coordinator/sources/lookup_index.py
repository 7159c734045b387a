"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix.

A model-free proposal source (transformers' ``prompt_lookup_num_tokens``, vLLM's n-gram
proposer). For a history ``t[0:L]`` it finds the longest n in ``max_ngram .. min_ngram`` whose
suffix ``t[L-n:L]`` also occurs earlier in the history, takes the most recent such earlier
occurrence ``t[p-n:p]`` (``p <= L - 1``) and proposes ``t[p:p+γ]``, none when nothing matches.
A copy that reaches the end of the history goes on copying what it proposes (LZ77's
overlapping copy: a period-(L − p) repetition continues), so a match close to the end — a
loop, a repeated line — still proposes γ tokens.

It runs where the tokens are (the coordinator) and costs no model call. The index is
incremental: one dict per n maps an n-gram to the position right after its most recent
occurrence, and appending a token adds one entry per n, so a round costs O(max_ngram) whatever
the history length. The index lags the history by one token on purpose: it holds every n-gram
that ends before the last token, so looking up the suffix finds only *earlier* occurrences
(never the suffix itself) and the continuation always has at least one token. Per n it also
chains each occurrence to the one before it (one int per position), so the continuations of
the few latest occurrences (`continuations`: the branches a token tree can carry) cost as many
steps as occurrences asked for.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Hashable, Sequence


class NgramIndex:
    """Per n, the n-gram -> position after its most recent occurrence (excluding the suffix)."""

    def __init__(self, max_ngram: int, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # _last[n - min_ngram]: n-gram key -> p, the index right after its latest occurrence
        self._last: list[dict[Hashable, int]] = [{} for _ in range(max_ngram - min_ngram + 1)]
        # _before[n - min_ngram][p]: the p of the same n-gram's occurrence before the one ending
        # at p - 1 (-1: none); indexed by p, one machine int per fed token
        self._before: list[array] = [array("q") for _ in range(max_ngram - min_ngram + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def feed(self, new_tokens: Sequence[int]) -> None:
        """Append tokens to the history, indexing the n-grams that now end before the last one."""
        tokens = self.tokens
        for token in new_tokens:
            end = len(tokens)  # the n-grams ending at end - 1 become "earlier" occurrences
            for i, before in enumerate(self._before):
                n = self.min_ngram + i
                if 0 < end and n <= end:
                    last, key = self._last[i], _key(tokens, end, n)
                    before.append(last.get(key, -1))
                    last[key] = end
                else:
                    before.append(-1)
            tokens.append(int(token))

    def match(self) -> tuple[int, int]:
        """(n, p): the longest suffix n-gram seen earlier and the position after its latest
        earlier occurrence; (0, -1) when none matches."""
        tokens, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            p = self._last[n - self.min_ngram].get(_key(tokens, length, n))
            if p is not None:
                return n, p
        return 0, -1

    def lookup(self, gamma: int) -> list[int]:
        """γ tokens that followed the latest earlier occurrence of the longest suffix (the copy
        running on into its own output past the end of the history); [] without a match."""
        return self.lookup_with_order(gamma)[1]

    def lookup_with_order(self, gamma: int) -> tuple[int, list[int]]:
        """(n, tokens): `lookup` and the length n of the suffix it matched (0: no match)."""
        n, p = self.match()
        if gamma <= 0 or p < 0:
            return 0, []
        return n, self._copy(p, gamma)  # past the end: the copy repeats with period L - p

    def continuations(self, gamma: int, occurrences: int) -> list[list[int]]:
        """The γ tokens after each of the `occurrences` latest earlier occurrences of the
        longest matched suffix (the latest first, as `lookup`), without repeats; [] without a
        match."""
        n, p = self.match()
        if gamma <= 0 or p < 0:
            return []
        out: list[list[int]] = []
        while p >= 0 and len(out) < occurrences:
            tokens = self._copy(p, gamma)
            if tokens not in out:
                out.append(tokens)
            p = self._before[n - self.min_ngram][p]
        return out

    def _copy(self, p: int, gamma: int) -> list[int]:
        """γ tokens from p on, the copy running on into itself past the end of the history."""
        out = self.tokens[p:p + gamma]
        period = len(self.tokens) - p
        while len(out) < gamma:
            out.append(out[len(out) - period])
        return out


def _key(tokens: list[int], end: int, n: int) -> Hashable:
    """The n-gram tokens[end-n:end] as a dict key (the bare int for unigrams: no tuple)."""
    return tokens[end - 1] if n == 1 else tuple(tokens[end - n:end])


@dataclass
class LookupStats:
    """A session's prompt-lookup feedback (vLLM's draft / accepted counters)."""

    proposals: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


class SessionLookup:
    """One per session: an incremental index kept in step with the session's history.

    ``propose(history, γ)`` then ``observe(proposed, accepted)`` — the two-method interface of
    transformers' candidate generators. The history is expected to grow by appending (the
    committed tokens of a session); a history that shrank or changed its last indexed token is
    re-indexed from scratch (O(history), rare).

    The prompt-lookup source (prompt_lookup.py) asks for the most the round may use and the
    planner cuts it: ``candidates = index.propose(history, cap)``; ``len(candidates)`` caps
    prompt lookup's γ; ``drafts = candidates[:gamma]``.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int = 16) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_ngram, self.min_ngram, self.max_tokens = max_ngram, min_ngram, max_tokens
        self.index = NgramIndex(max_ngram, min_ngram)
        self.stats = LookupStats()
        self.last_order = 0  # n of the suffix the last proposal matched (0: none)

    def feed(self, new_tokens: Sequence[int]) -> None:
        """Append tokens to the indexed history (when the caller tracks the increments itself)."""
        self.index.feed(new_tokens)

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index in step with `history`: feed its new tail, or rebuild after a change."""
        known = len(self.index)
        if known > len(history) or (known and history[known - 1] != self.index.tokens[-1]):
            self.index = NgramIndex(self.max_ngram, self.min_ngram)
            known = 0
        if len(history) > known:
            self.index.feed(history[known:])

    def propose(self, history: Sequence[int], gamma: int) -> list[int]:
        """min(γ, max_tokens) tokens continuing `history`; [] when no suffix matches."""
        self.sync(history)
        self.last_order, tokens = self.index.lookup_with_order(min(gamma, self.max_tokens))
        return tokens

    def continuations(self, gamma: int, occurrences: int) -> list[list[int]]:
        """After `propose`: min(γ, max_tokens) tokens after each of the `occurrences` latest
        earlier occurrences of the suffix it matched, distinct, the latest first."""
        return self.index.continuations(min(gamma, self.max_tokens), occurrences)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Feedback after verification: how many of the proposed tokens the target accepted."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {num_accepted}, {num_proposed}")
        if num_proposed:
            self.stats.proposals += 1
            self.stats.proposed_tokens += num_proposed
            self.stats.accepted_tokens += num_accepted
