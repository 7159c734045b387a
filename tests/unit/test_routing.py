"""Rendezvous hashing: each session has one replica per tier; membership changes move few sessions."""

from __future__ import annotations

from collections import Counter

from coordinator.sessions.routing import rank, weight

SESSIONS = [f"session-{i:05d}" for i in range(3000)]
REPLICAS = [f"10.0.0.{i}:50053" for i in range(1, 6)]


def owners(replicas):
    return {s: rank(s, replicas)[0] for s in SESSIONS}


def test_choice_is_stable_and_spread():
    before = owners(REPLICAS)
    assert before == owners(list(reversed(REPLICAS)))  # the order of the list does not matter
    counts = Counter(before.values())
    assert set(counts) == set(REPLICAS)
    for replica in REPLICAS:  # each of 5 replicas gets about a fifth (600 of 3000)
        assert 450 < counts[replica] < 750, counts


def test_a_joining_replica_takes_only_its_share():
    before = owners(REPLICAS)
    joined = "10.0.0.9:50053"
    after = owners(REPLICAS + [joined])
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == joined for s in moved)  # only to the new replica
    assert 0.12 < len(moved) / len(SESSIONS) < 0.22, len(moved)  # about 1/6


def test_a_leaving_replica_moves_only_its_sessions():
    before = owners(REPLICAS)
    gone = REPLICAS[2]
    after = owners([r for r in REPLICAS if r != gone])
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert set(moved) == {s for s in SESSIONS if before[s] == gone}
    # they spread over the others, each to its next replica in rank order
    assert len(Counter(after[s] for s in moved)) == len(REPLICAS) - 1
    assert all(after[s] == rank(s, REPLICAS)[1] for s in moved)


def test_weight_is_deterministic_and_pair_specific():
    assert weight("s", "a:1") == weight("s", "a:1")
    assert weight("s", "a:1") != weight("s", "a:2") != weight("t", "a:1")
    assert 0 <= weight("s", "a:1") < 2 ** 64
