"""bench/launches.py: what it counts on hand-made operations, and a run on the tiny model whose
table and JSON hold sane counts."""

from __future__ import annotations

import json

import pytest
import torch

from bench import launches


def test_the_counter_sees_each_kind_of_host_synchronisation():
    x = torch.arange(6, dtype=torch.float32)

    def work():
        y = (x * 2 + 1).sum()                    # two launches (mul, add) and a reduction
        float(y)                                  # an item
        x.tolist()                                # a read
        x[x > 2]                                  # an output sized by data
        torch.tensor([1, 2], device=x.device)     # a blocking upload
        torch.tensor([1, 2])                      # host data made on the host: none
        return y

    _, counts = launches.profile_call(work)
    assert (counts.items, counts.reads, counts.uploads) == (1, 1, 1)
    assert counts.sized >= 1
    assert counts.syncs == counts.items + counts.reads + counts.sized + counts.uploads
    assert counts.launches >= 3
    assert counts.aten_ops > counts.launches  # views, allocations and composites are not launches
    _, none = launches.profile_call(lambda: x.view(2, 3).t())
    assert (none.launches, none.syncs) == (0, 0)
    assert torch.Tensor.tolist is not None and torch.tensor([3]).tolist() == [3]  # patches undone


def test_a_tree_is_listed_parents_first():
    from specdec.maths.tree import TokenTree

    parents = launches.tree_parents(8)
    TokenTree(tuple(range(8)), parents).check()
    assert parents[:4] == (0, 0, 1, 1)


def test_a_run_on_the_tiny_model_writes_sane_counts(tmp_path, capsys):
    assert launches.main(["--models", "tiny", "--histories", "16,80", "--gammas", "1,4", "--tree-nodes", "4",
                          "--repeats", "1", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "launches.json").read_text())
    assert set(document["engines"]) == {"torch", "graph"}
    for engine in ("torch", "graph"):
        check_counts(document["engines"][engine]["models"]["tiny"]["histories"])
    torch_rows = document["engines"]["torch"]["models"]["tiny"]["histories"]["80"]["rows"]
    graph_rows = document["engines"]["graph"]["models"]["tiny"]["histories"]["80"]["rows"]
    # the graph engine decides a sampled round's acceptance on the device: one read, no per-draft items
    assert graph_rows["verify γ=4 sampled"]["syncs"] < torch_rows["verify γ=4 sampled"]["syncs"]
    # and a tree's (batched_tree_acceptance.py): the host walk reads per child tested and per draw
    assert graph_rows["verify tree n=4 sampled"]["syncs"] == 1 < torch_rows["verify tree n=4 sampled"]["syncs"]
    table = capsys.readouterr().out
    assert "target step (verify, no drafts)" in table and "per draft step" in table
    assert (tmp_path / "launches.txt").read_text().startswith("engine")


def check_counts(by_history: dict) -> None:
    assert set(by_history) == {"16", "80"}
    for measured in by_history.values():
        rows = measured["rows"]
        assert set(rows) >= {"draft step (propose γ=1)", "propose γ=4", "target step (verify, no drafts)",
                             "verify γ=1", "verify γ=4", "verify tree n=4", "verify γ=4 sampled",
                             "verify tree n=4 sampled"}
        for name, counts in rows.items():
            assert 0 < counts["launches"] < counts["aten_ops"], name
            assert counts["syncs"] >= 1, name  # every call reads its answer back
        one, four = rows["draft step (propose γ=1)"], rows["propose γ=4"]
        assert 3.5 * one["launches"] <= four["launches"] <= 4.5 * one["launches"]  # a forward per step
        assert measured["per_draft_step"]["launches"] == pytest.approx((four["launches"] - one["launches"]) / 3)
