"""The timed device of the benchmarks (bench/timed_device.py, bench/pace_tables.py): its roofline,
its tables, that a forward takes at least the table's time, and that the tokens stay exact."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from bench import pace_tables
from bench.pace_tables import CostTable, Shape, roofline_seconds
from bench.timed_device import TimedForwards, forward_shape, hold_until
from tests.cluster import Cluster

TOY = Shape("toy", params=1e9, kv_bytes_per_token=1000)


@pytest.mark.unit
def test_the_roofline_reads_the_weights_once_and_each_rows_kv():
    # 2 GB of weights at 1 TB/s: 2 ms; each row's 100 cached + 1 new token of K/V on top
    assert roofline_seconds(TOY, 1, 1, 0, 1e12, flops=1e30) == pytest.approx(2e-3 + 1000 / 1e12)
    four = roofline_seconds(TOY, 4, 1, 100, 1e12, flops=1e30)
    assert four == pytest.approx((2e9 + 4 * 101 * 1000) / 1e12)
    assert roofline_seconds(TOY, 0, 5, 100, 1e12) == 0.0 and roofline_seconds(TOY, 3, 0, 100, 1e12) == 0.0


@pytest.mark.unit
def test_the_roofline_turns_compute_bound_with_enough_tokens_and_splits_by_tensor_parallel():
    # 1000 tokens × 2 GFLOP at 1 TFLOP/s = 2 s, far above the 2 ms of weights
    assert roofline_seconds(TOY, 100, 10, 0, 1e12, flops=1e12) == pytest.approx(2.0)
    split = Shape("toy-tp4", 1e9, 1000, tensor_parallel=4)
    assert roofline_seconds(split, 1, 1, 0, 1e12, flops=1e30) == pytest.approx(roofline_seconds(TOY, 1, 1, 0, 1e12, flops=1e30) / 4)
    with pytest.raises(ValueError):
        roofline_seconds(TOY, -1, 1, 0, 1e12)


@pytest.mark.unit
def test_the_ready_tables_give_the_issues_step_times():
    decode = {name: 1e3 * pair.target.seconds(1, 1, 512) for name, pair in pace_tables.TABLES.items()}
    assert 3.4 < decode["h200-7b"] < 3.9  # "about 3.6 ms at the H200's memory bandwidth"
    assert decode["h200-1.5b"] < 1.0
    assert 9 < decode["h100-70b"] < 13  # "about 10 ms" at TP 4
    draft = pace_tables.TABLES["h200-7b"].draft
    assert draft.seconds(1, 1, 512) < 1e-3  # "a 0.5B draft step well under 1 ms"
    assert draft.draft_loop_seconds(1, 4, 512) == pytest.approx(sum(draft.seconds(1, 1, 512 + i) for i in range(4)))


@pytest.mark.unit
def test_a_measured_curve_replaces_the_roofline(tmp_path):
    doc = {"shapes": {"7b": {"engines": {"graph": {"curve": {"ms": {"1": 3.0, "5": 3.4, "33": 6.2}}}}}}}
    (tmp_path / "gpu.json").write_text(json.dumps(doc))
    pair = pace_tables.from_gpu_json(tmp_path / "gpu.json", "7b")
    assert pair.target.seconds(1, 1, 100) == pytest.approx(3.0e-3)
    assert pair.target.seconds(1, 3, 100) == pytest.approx(3.2e-3)  # between 1 and 5
    assert pair.target.seconds(4, 5, 100) == pytest.approx((3.4 + 2.8 * 15 / 28) * 1e-3)  # 20 tokens
    assert pair.draft is pace_tables.TABLES["h200-7b"].draft
    with pytest.raises(ValueError, match="no graph curve"):
        pace_tables.from_gpu_json(tmp_path / "gpu.json", "1.5b")


def _rows(tokens: list[int], cached: list[int]) -> list:
    return [SimpleNamespace(tokens=[0] * t, entry=[0] * c) for t, c in zip(tokens, cached)]


@pytest.mark.unit
def test_a_forward_is_shaped_by_its_longest_row_and_mean_cache():
    assert forward_shape(_rows([1, 5, 2], [10, 20, 30])) == (3, 5, 20)
    assert forward_shape([]) == (0, 0, 0)


@pytest.mark.unit
def test_a_hold_returns_at_its_deadline_not_before():
    for wait in (0.0, 2e-4, 3e-3):
        deadline = time.perf_counter() + wait
        hold_until(deadline)
        assert time.perf_counter() >= deadline


@pytest.mark.unit
def test_a_timed_forward_takes_at_least_the_tables_time_and_counts_an_overrun():
    table = CostTable("fixed", TOY, bandwidth=1e30, flops=1e30, fixed_s=5e-3)
    engine = SimpleNamespace(forward_batch=lambda rows: ["logits"] * len(rows))
    timer = TimedForwards(table)
    timer.install(engine)
    start = time.perf_counter()
    assert engine.forward_batch(_rows([1, 1], [3, 3])) == ["logits", "logits"]
    assert time.perf_counter() - start >= 5e-3
    slow = SimpleNamespace(forward_batch=lambda rows: time.sleep(0.02) or [])
    timer.install(slow)
    slow.forward_batch(_rows([1], [0]))
    stats = timer.stats()
    assert (stats["calls"], stats["overruns"]) == (2, 1)
    assert stats["table_ms"] == pytest.approx(10.0) and stats["compute_ms"] >= 20.0
    assert stats["late_us_p50"] >= 0


@pytest.mark.service
def test_the_timed_device_keeps_the_tokens_exact(models):
    llama = models["llama"]
    fields = dict(prompt="def f(x):", max_new_tokens=24, num_speculative_tokens=4, ignore_eos=True)
    with Cluster(llama["draft"], llama["target"]) as cluster:
        plain = [t for r in cluster.stream(**fields) for t in r.token_ids]
        table = CostTable("slow", TOY, bandwidth=1e30, flops=1e30, fixed_s=1e-3)
        timers = {name: TimedForwards(table) for name in ("draft", "target")}
        timers["draft"].install(cluster.draft_servicer.engine)
        timers["target"].install(cluster.target_servicer.engine)
        timed = [t for r in cluster.stream(**fields) for t in r.token_ids]
    assert timed == plain and len(plain) == 24
    for timer in timers.values():  # every forward held: at least 1 ms each
        stats = timer.stats()
        assert stats["calls"] > 0 and stats["table_ms"] == pytest.approx(stats["calls"] * 1.0)
