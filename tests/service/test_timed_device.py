"""The timed device of the benchmarks (bench/timed_device.py, bench/pace_tables.py): its roofline,

Here the service tests; the others are in tests/unit/test_timed_device.py."""

from __future__ import annotations

import pytest
from bench.pace_tables import CostTable
from bench.timed_device import TimedForwards

from tests.cluster import Cluster
from tests.unit.test_timed_device import TOY


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
