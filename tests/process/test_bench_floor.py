"""bench/transport_floor.py: the round's messages with no work behind them, between three real
processes on loopback; the rounds it counts follow from the answers its services give (the
floor target accepts every draft: γ + 1 tokens a round)."""

from __future__ import annotations

from bench import transport_floor


def test_the_floor_counts_each_round_once_and_times_every_process():
    floor = transport_floor.measure([2, 0], requests=2, max_new_tokens=12)
    # γ = 2: 3 tokens a round, 4 rounds (3 gaps between chunks) per stream; γ = 0: 12 rounds
    assert floor[2]["rounds"] == 2 * 3 and floor[0]["rounds"] == 2 * 11
    for row in floor.values():
        assert 0 < row["p50"] <= row["p99"]
        assert row["cpu_coordinator_ms"] > 0 and row["cpu_target_ms"] > 0 and row["cpu_client_ms"] >= 0
    assert floor[0]["cpu_draft_ms"] < floor[2]["cpu_draft_ms"]  # γ = 0 makes no Propose call
