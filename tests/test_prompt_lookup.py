"""Prompt lookup on hand-built histories, and the incremental index against a brute-force scan."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.sources.lookup_index import NgramIndex, SessionLookup

pytestmark = pytest.mark.unit


def brute_force(history, gamma, max_ngram, min_ngram=1):
    """Rescan: longest suffix n-gram with an earlier occurrence, the latest one, its continuation
    (copied token by token, so a copy reaching the end goes on copying its own output)."""
    length = len(history)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length - 1:
            continue
        suffix = list(history[length - n:])
        for start in range(length - n - 1, -1, -1):
            if list(history[start:start + n]) == suffix:
                text = list(history)
                for i in range(gamma):
                    text.append(text[start + n + i])
                return text[length:]
    return []


def test_longest_match_wins():
    # suffix 2-gram (8, 9) occurs at 0..1 (followed by 1); suffix 1-gram (9) occurs later at 4
    # (followed by 5). The longer match wins although the shorter one is more recent.
    history = [8, 9, 1, 2, 9, 5, 8, 9]
    assert SessionLookup(max_ngram=3).propose(history, 3) == [1, 2, 9]
    # with only unigrams allowed, the most recent 9 (followed by 5, 8, 9) wins
    assert SessionLookup(max_ngram=1).propose(history, 3) == [5, 8, 9]


def test_most_recent_match_wins_among_equal_n():
    history = [1, 2, 10, 11, 1, 2, 20, 21, 7, 1, 2]
    assert SessionLookup(max_ngram=2).propose(history, 2) == [20, 21]
    assert SessionLookup(max_ngram=4).propose(history, 2) == [20, 21]


def test_no_match_no_proposal():
    assert SessionLookup(max_ngram=3).propose([1, 2, 3, 4, 5], 4) == []
    assert SessionLookup().propose([], 4) == []
    assert SessionLookup().propose([7], 4) == []
    # min_ngram=2: a unigram match alone does not count
    assert SessionLookup(max_ngram=3, min_ngram=2).propose([5, 1, 6, 1], 4) == []
    assert SessionLookup(max_ngram=3, min_ngram=1).propose([5, 1, 6, 1], 4) == [6, 1, 6, 1]


def test_match_at_the_end_copies_on_into_its_own_output():
    # the latest earlier occurrence of (3, 4) ends right before the suffix: the history ends
    # after 2 tokens of its continuation, and the copy goes on with what it proposed (period 2)
    history = [1, 3, 4, 3, 4]
    assert SessionLookup(max_ngram=2).propose(history, 5) == [3, 4, 3, 4, 3]
    assert SessionLookup(max_ngram=3).propose([6, 6, 6], 5) == [6] * 5
    assert SessionLookup(max_ngram=2).propose([6, 6, 6, 6], 5) == [6] * 5  # latest: 1..2
    assert SessionLookup(max_ngram=2).propose([9, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]  # period 3


def test_gamma_and_max_tokens_limit():
    history = list(range(10)) + [0, 1]
    lookup = SessionLookup(max_ngram=2, max_tokens=16)
    assert lookup.propose(history, 3) == [2, 3, 4]
    assert lookup.propose(history, 0) == []
    assert SessionLookup(max_ngram=2, max_tokens=2).propose(history, 5) == [2, 3]


def test_incremental_sync_follows_appends_and_rebuilds_after_a_change():
    lookup = SessionLookup(max_ngram=3)
    history = [1, 2, 3, 1, 2]
    assert lookup.propose(history, 2) == [3, 1]
    history += [3, 9, 1, 2, 3]
    assert lookup.propose(history, 2) == [9, 1]          # fed the tail only
    assert len(lookup.index) == len(history)
    assert lookup.propose([4, 5, 4], 2) == [5, 4]        # shorter history: re-indexed
    assert lookup.propose([4, 5, 7, 4], 2) == [5, 7]     # last indexed token changed: re-indexed


def test_feed_matches_propose_from_history():
    lookup = SessionLookup(max_ngram=3)
    lookup.feed([1, 2, 3, 4])
    lookup.feed([1, 2])
    assert lookup.index.lookup(3) == [3, 4, 1]
    assert lookup.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # already in step: nothing re-fed


def test_observe_keeps_acceptance_stats():
    lookup = SessionLookup()
    lookup.observe(4, 3)
    lookup.observe(0, 0)     # a round without proposal is not a proposal
    lookup.observe(2, 0)
    assert (lookup.stats.proposals, lookup.stats.proposed_tokens, lookup.stats.accepted_tokens) \
        == (2, 6, 3)
    assert lookup.stats.acceptance_rate == 0.5
    with pytest.raises(ValueError):
        lookup.observe(2, 3)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=0, min_ngram=0)
    with pytest.raises(ValueError):
        SessionLookup(max_tokens=0)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60),
       chunks=st.lists(st.integers(1, 7), min_size=1, max_size=20),
       max_ngram=st.integers(1, 4), min_ngram=st.integers(1, 4), gamma=st.integers(0, 6))
def test_incremental_equals_brute_force(tokens, chunks, max_ngram, min_ngram, gamma):
    """Fed in random chunks, every intermediate proposal equals a full rescan."""
    min_ngram = min(min_ngram, max_ngram)
    lookup = SessionLookup(max_ngram=max_ngram, min_ngram=min_ngram, max_tokens=16)
    history: list[int] = []
    position, i = 0, 0
    while position < len(tokens):
        step = chunks[i % len(chunks)]
        history.extend(tokens[position:position + step])
        position, i = position + step, i + 1
        assert lookup.propose(history, gamma) == brute_force(history, gamma, max_ngram, min_ngram)


def test_long_history_rounds():
    """A 32k-token history, then 1000 rounds of propose + append (the round loop's use).

    Measured on the 2-core dev machine (CPython 3.11, max_ngram=3): indexing the 32k-token
    history ~25 ms; 1000 rounds of propose(γ=8) + ~4 appended tokens ~5 ms in all (~5 µs a
    round, flat in the history length); a full rescan (brute_force above) costs ~8 ms for ONE
    round at 36k tokens. The index of 32k random tokens holds ~8 MB (tracemalloc).
    The figures are printed with `pytest -s`; the test asserts results, not times.
    """
    rng = random.Random(0)
    # a code-like history: a few recurring phrases with random tokens between them
    phrases = [[rng.randrange(1000) for _ in range(rng.randrange(3, 12))] for _ in range(50)]
    history: list[int] = []
    while len(history) < 32_768:
        history += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(1000)]
    lookup = SessionLookup(max_ngram=3, max_tokens=8)
    t0 = time.perf_counter()
    lookup.sync(history)
    t_index = time.perf_counter() - t0
    hits, checks = 0, []
    t0 = time.perf_counter()
    for round_ in range(1000):
        proposal = lookup.propose(history, 8)
        hits += bool(proposal)
        if round_ % 100 == 0:
            checks.append((len(history), proposal))
        history += proposal[:3] + [rng.randrange(1000)] if proposal else rng.choice(phrases)[:4]
    t_rounds = time.perf_counter() - t0
    for length, proposal in checks:
        assert proposal == brute_force(history[:length], 8, 3)
    t0 = time.perf_counter()
    reference = brute_force(history, 8, 3)
    t_scan = time.perf_counter() - t0
    assert lookup.propose(history, 8) == reference
    assert hits > 500
    print(f"\nindex 32k: {t_index * 1e3:.1f} ms; 1000 rounds: {t_rounds * 1e3:.1f} ms; "
          f"one rescan at {len(history)} tokens: {t_scan * 1e3:.1f} ms")


def test_continuations_follow_the_latest_occurrences_of_the_matched_suffix():
    index = NgramIndex(max_ngram=3)
    index.feed([1, 2, 3, 9, 1, 2, 4, 1, 2, 5, 8, 1, 2])
    assert index.match() == (2, 9)  # "1 2": the 3-gram "8 1 2" never occurred before
    assert index.continuations(3, 4) == [[5, 8, 1], [4, 1, 2], [3, 9, 1]]
    assert index.continuations(3, 1) == [index.lookup(3)]
    assert index.continuations(0, 3) == [] and NgramIndex(2).continuations(3, 3) == []
    repeats = NgramIndex(max_ngram=2)
    repeats.feed([7, 7, 7, 7])  # every earlier "7 7" continues the same way: no repeats
    assert repeats.continuations(3, 3) == [[7, 7, 7]]


def test_continuations_agree_with_a_scan_of_the_history():
    rng = random.Random(0)
    for _ in range(50):
        history = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        index = NgramIndex(max_ngram=3)
        index.feed(history)
        n, _ = index.match()
        expected: list[list[int]] = []
        if n:
            ends = [p for p in range(len(history) - 1, n - 1, -1) if history[p - n:p] == history[-n:]]
            for p in ends:  # the latest first, each copied on into itself as `lookup` does
                tokens = history[p:p + 3]
                while len(tokens) < 3:
                    tokens.append(tokens[len(tokens) - (len(history) - p)])
                if tokens not in expected and len(expected) < 3:
                    expected.append(tokens)
        assert index.continuations(3, 3) == expected, history
