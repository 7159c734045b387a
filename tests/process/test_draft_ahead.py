"""Drafting ahead (the coordinator's --draft-ahead): while a round is verified, the draft goes
on past that round's drafts, its first token a guess of the target's bonus token; when the
target accepts every draft and its bonus is the guess, the next round verifies the rest with
no draft call.

Here the process tests; the other tiers' are in tests/e2e/test_draft_ahead.py. The tier split shares one description: see tests/e2e/test_draft_ahead.py.
"""

from __future__ import annotations

from tests.procs import Coordinator, ServiceProcess, start_together
from tests.e2e.test_draft_ahead import AHEAD


def test_a_draft_killed_mid_stream_with_calls_made_ahead(models):
    """The draft process dies while calls are made ahead (the target as its own draft: nearly
    every round has one in flight): the rounds fall back to the target alone and the output is
    the same as without the fault."""
    target = models["llama"]["target"]
    draft, verifier = start_together(ServiceProcess("draft", target), ServiceProcess("target", target))
    coordinator = Coordinator(draft.address, verifier.address, draft_retry_s=0.5, **AHEAD)
    request = dict(prompt="def fibonacci(n):", max_new_tokens=200, num_speculative_tokens=3, ignore_eos=True)
    try:
        first = coordinator.complete(**request)
        assert first.stats.draft_ahead_rounds > 0
        tokens, last = [], None
        for i, chunk in enumerate(coordinator.stream(**request)):
            tokens.extend(chunk.token_ids)
            last = chunk
            if i == 1:
                draft.kill()
        assert tokens == list(first.token_ids)
        assert last.stats.fallback_rounds > 0
    finally:
        coordinator.stop()
        draft.stop()
        verifier.stop()
