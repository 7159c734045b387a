"""bench/overhead.py's link sweep (--link-delay-ms): the delays it takes, the proxy process it
puts in front of each service, and how it turns the timed cells into its rows and its
drafting-ahead comparison.

Here the unit tests; the other tiers' are in tests/process/test_bench_overhead.py.
"""

from __future__ import annotations

import argparse
import json

import pytest

from bench import overhead_links
from bench.overhead_timing import Intervals


def test_link_delays_keep_their_order_and_refuse_what_is_no_delay():
    assert overhead_links.parse_delays("0,0.2,0.5,1,2") == [0.0, 0.2, 0.5, 1.0, 2.0]
    assert overhead_links.parse_delays("1,0,1") == [1.0, 0.0]
    for bad in ("-1", "nan", "inf", "x", "0,,1"):
        with pytest.raises(ValueError):
            overhead_links.parse_delays(bad)


def test_the_jitter_is_a_tenth_of_the_delay_unless_given():
    default, given = argparse.Namespace(link_jitter_ms=None), argparse.Namespace(link_jitter_ms=0.05)
    assert overhead_links.jitter_of(default, 2.0) == pytest.approx(0.2)
    assert overhead_links.jitter_of(default, 0.0) == 0.0 and overhead_links.jitter_of(given, 0.0) == 0.0  # loopback
    assert overhead_links.jitter_of(given, 2.0) == 0.05


def _tally(tokens: int, seconds: float, ahead_calls: int = 0, ahead_rounds: int = 0) -> dict:
    return {"tokens": tokens, "seconds": seconds, "rounds": 3, "generated_tokens": tokens + 1, "draft_rounds": 3,
            "draft_tokens": 6, "accepted_tokens": tokens, "draft_ahead_calls": ahead_calls,
            "draft_ahead_rounds": ahead_rounds}


def test_the_sweep_compares_drafting_ahead_on_with_off_at_each_delay(tmp_path, capsys):
    for name in ("link-direct-off-on-stream", "link-direct-on-on-stream"):
        (tmp_path / f"coordinator-{name}.json").write_text(json.dumps({"calls": [], "saves": []}))
    # two repeats of one request each; off takes 20 ms for its 4 timed tokens, on 10 ms (then 8)
    cells = {
        (0.0, "on", "stream", 2, "off"): {"coordinator": "link-direct-off-on-stream",
                                          "stamps": [[1.0, 1.010, 1.020], [2.0, 2.010, 2.020]],
                                          "tallies": [_tally(4, 0.020), _tally(4, 0.020)],
                                          "cpu": {"coordinator": 0.004, "proxy_draft": None}},
        (0.0, "on", "stream", 2, "on"): {"coordinator": "link-direct-on-on-stream",
                                         "stamps": [[3.0, 3.005, 3.010], [4.0, 4.005, 4.010]],
                                         "tallies": [_tally(4, 0.010, 2, 1), _tally(4, 0.005, 2, 2)],
                                         "cpu": {"coordinator": 0.002, "proxy_draft": None}},
    }
    # in each round of off, the draft works 4 ms and the target 4 ms, 2 ms of them at once: 6 ms
    work = Intervals([(start + a, start + b) for stamps in cells[0.0, "on", "stream", 2, "off"]["stamps"]
                      for start in stamps[:-1] for a, b in ((0, 0.004), (0.002, 0.006))]).merged()
    args = argparse.Namespace(link_jitter_ms=None, link_repeats=2, max_new_tokens=8, pair="near")
    sweep = {"cells": cells, "bare": {0.0: {"p50": 1.0, "p99": 2.0}}, "requests_per_repeat": 1}
    link = overhead_links.link_results(args, [0.0], sweep, tmp_path, work, Intervals(), Intervals())

    off, on = link["rows"]["delay_0_on_stream_gamma_2_ahead_off"], link["rows"]["delay_0_on_stream_gamma_2_ahead_on"]
    assert off["rounds"] == 4 and off["wall_p50"] == pytest.approx(10.0)
    assert off["work_p50"] == pytest.approx(6.0) and off["orchestration_p50"] == pytest.approx(4.0)
    assert on["work_p50"] == 0.0 and on["orchestration_p50"] == pytest.approx(5.0)
    assert off["ms_per_token"] == pytest.approx(5.0) and on["ms_per_token"] == pytest.approx(15 / 8)
    assert off["cpu_coordinator_ms"] == pytest.approx(1.0) and on["cpu_proxy_draft_ms"] is None
    ahead = link["draft_ahead"]["delay_0_on_stream_gamma_2"]
    assert ahead["ratio"] == pytest.approx((8 / 0.015) / (8 / 0.040))
    assert ahead["repeat_ratios"] == pytest.approx([2.0, 4.0])
    assert (ahead["draft_ahead_calls"], ahead["draft_ahead_rounds"], ahead["draft_rounds"]) == (4, 3, 6)
    assert ahead["draft_ahead_calls_off"] == 0

    overhead_links.report_link(args, link)
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if "[2.00, 4.00]" in line)
    assert line.split()[:4] == ["0", "on", "stream", "2"] and "2.667" in line.split()
    assert line.split()[-2:] == ["4/6", "3/6"]
