"""Streamed deltas never show the start of a stop string that completes later.

The stop string is taken from the greedy output itself so that it starts in one token and
ends in the next: with γ = 0 each round commits one token, so the first part of the stop
string is committed a round before it completes. Every prefix of the stream must stay within
the text before the stop string.
"""

from __future__ import annotations

import pytest


PROMPT = "The quick brown fox"
NEW_TOKENS = 32
FINISH_STOP = 3  # FINISH_REASON_STOP


def _spanning_stop(deltas: list[str]) -> tuple[str, int]:
    """A printable stop string made of the end of one round's delta and the start of the next
    one's, whose first occurrence in the whole text is there: (stop, where it starts)."""
    text = "".join(deltas)
    boundary = 0
    for i, (left, right) in enumerate(zip(deltas, deltas[1:])):
        boundary += len(left)
        if i < 2 or not left or not right:
            continue
        for take_left, take_right in ((2, 2), (1, 2), (2, 1), (1, 1)):
            if len(left) < take_left or len(right) < take_right:
                continue
            start = boundary - take_left
            stop = text[start:boundary + take_right]
            readable = all(ch.isprintable() and ch != "\ufffd" for ch in stop)
            if readable and text.find(stop) == start:
                return stop, start
    raise AssertionError(f"no token boundary with a usable stop string in {deltas!r}")


@pytest.mark.parametrize("gamma", [0, 3])
def test_streamed_deltas_hold_back_a_partial_stop_string(llama_cluster, gamma):
    # one token per chunk (γ = 0): each chunk's delta is that token's text
    plain = llama_cluster.stream(prompt=PROMPT, max_new_tokens=NEW_TOKENS, num_speculative_tokens=0,
                           ignore_eos=True)
    assert all(len(c.token_ids) == 1 for c in plain)
    deltas = [c.text for c in plain]
    stop, start = _spanning_stop(deltas)
    text = "".join(deltas)
    assert start > 0 and stop not in text[:start]

    chunks = llama_cluster.stream(prompt=PROMPT, max_new_tokens=NEW_TOKENS, num_speculative_tokens=gamma,
                            ignore_eos=True, stop=[stop])
    assert chunks[-1].finish_reason == FINISH_STOP
    streamed = ""
    for chunk in chunks:
        streamed += chunk.text
        # never more than the text before the stop string: not even its first character
        assert len(streamed) <= start, (
            f"the stream showed {streamed[start:]!r}, the start of stop string {stop!r}")
        assert text.startswith(streamed)
    assert streamed == text[:start]
