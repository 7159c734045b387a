"""bench/kv_memory.py's arithmetic: theoretical K/V bytes per token from a config, and the
bytes a session's cache accounts and allocates against it, through the services' runner."""

from __future__ import annotations

import pytest

from bench.kv_memory import kv_geometry, measure_model, theoretical_bytes_per_token
from specdec_cli import tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.build_pair(tmp_path_factory.mktemp("kv"), width=32, layers=3, context=1024)


def test_geometry_of_grouped_query_and_gpt2_configs():
    llama = tiny.model_config("llama", 384, 0, width=32, layers=3)  # 4 heads, 2 of them K/V
    assert kv_geometry(llama) == {"layers": 3, "kv_heads": 2, "head_dim": 8}
    assert theoretical_bytes_per_token(**kv_geometry(llama), dtype_bytes=2) == 3 * 2 * 2 * 8 * 2
    gpt2 = tiny.model_config("gpt2", 384, 0, width=32, layers=2)  # no GQA: every head has K/V
    assert kv_geometry(gpt2) == {"layers": 2, "kv_heads": 4, "head_dim": 8}


def test_cache_bytes_against_theory(pair):
    _, target = pair
    result = measure_model(str(target), "target", "float32", "cpu", [40, 600, 5000], decode_steps=4, rollback=2)
    assert result["theoretical_bytes_per_token"] == 3 * 2 * 2 * 8 * 4 == result["runner_bytes_per_token"]
    assert result["skipped_lengths"] == [5000]  # past the 1024-token context
    rows = {row["session"]: row for row in result["sessions"]}
    assert [r["tokens_held"] for r in result["sessions"]] == [40, 44, 42, 600, 604, 602]
    for row in result["sessions"]:
        assert row["accounted_bytes"] == row["allocated_bytes"]  # a buffer: what is counted is allocated
        assert row["theoretical_bytes"] == row["tokens_held"] * 384
    # a growth reserves needed + max(4, needed / 16) tokens, in 4-token grains: 40 -> 44 (room for
    # the 4 decoded); 600 in 512-token prefill chunks -> 544, then 600 + 37 -> 640
    assert rows["40: +4 decode"]["allocated_bytes"] == 44 * 384
    assert rows["600: prefill"]["allocated_bytes"] == 640 * 384
    assert 1.0 < rows["600: -2 rollback"]["allocated_over_theory"] <= 1.07
    total = result["total"]
    assert total["tokens_held"] == 42 + 602 and total["accounted_bytes"] == (44 + 640) * 384
