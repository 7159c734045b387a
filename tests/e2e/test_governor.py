"""The load governor: short trials of speculation against plain decoding, the winner held.

Here the e2e tests; the other tiers' are in tests/unit/test_governor.py.
"""

from __future__ import annotations

from coordinator.policy.load_governor import PLAIN


def test_while_plain_decoding_holds_the_draft_gets_no_call_at_all(models):
    """Under a plain verdict an adaptive request neither drafts nor sends the draft its prompt
    ahead (work for a draft round that will not come), and its output is target-only's."""
    import time

    from tests.cluster import Cluster
    from tests.spies import RequestRecorder

    recorder = RequestRecorder("Propose", "Verify")
    paths = models["llama"]
    prompt = [3, 7, 5, 2, 8, 9, 4, 6, 1]
    with Cluster(paths["draft"], paths["target"], interceptors=[recorder]) as cluster:
        governor = cluster.coordinator.round_loop.governor
        governor.min_load = 1  # govern this single stream: plain decoding holds at every load
        governor.verdicts[0] = (PLAIN, time.monotonic(), 0.0, governor.hold_s)
        held = cluster.complete(token_ids=prompt, max_new_tokens=12, ignore_eos=True)
        calls = [name for name, _ in recorder.take()]
        assert calls.count("Propose") == 0 and calls.count("Verify") == 12, calls
        assert held.stats.draft_rounds == 0 and held.stats.draft_prefill_tokens == 0
        plain = cluster.complete(token_ids=prompt, max_new_tokens=12, ignore_eos=True, num_speculative_tokens=0)
        assert list(held.token_ids) == list(plain.token_ids)
