"""Planning a request's round as the round loop does: prompt lookup (the source) looks the
history up where the plan would use it, and the request's planner chooses from what it found."""

from __future__ import annotations

from typing import Sequence
from weakref import WeakKeyDictionary

from coordinator.policy.speculation import NO_LOOKUP, Offers, Plan, RequestSpeculation
from coordinator.sources.prompt_lookup import PromptLookup

# one prompt-lookup source per request, as the round loop keeps one index per running session
_LOOKUPS: WeakKeyDictionary[RequestSpeculation, PromptLookup] = WeakKeyDictionary()


def plan_round(request: RequestSpeculation, history: Sequence[int], cap: int, draft_available: bool,
         allowed: bool = True, *, max_ngram: int = 3, max_tokens: int = 8) -> Plan:
    """`request`'s next plan for `history`: RoundLoop._plan without the round around it."""
    source = _LOOKUPS.setdefault(request, PromptLookup(max_ngram, max_tokens))
    lookup = source.look("session", history, cap) if request.looks_up(cap, allowed) else NO_LOOKUP
    return request.plan(Offers(lookup, draft_available), cap, allowed=allowed)
