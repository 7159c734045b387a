"""bench/speedup.py's rows per --tree setting and --methods (the suite itself runs real
services: not here), and bench/policy_sim.py's run."""

from __future__ import annotations

import json

import pytest

from bench import report
from bench.speedup import AUTO_CHAINS, select_methods, specdec_methods


def tree_fields(methods: dict[str, dict]) -> dict[str, int]:
    return {name: fields["tree_nodes"] for name, fields in methods.items() if "tree_nodes" in fields}


def test_tree_off_has_chains_only():
    assert tree_fields(specdec_methods(quick=True, tree="off")) == {}


def test_tree_on_adds_fixed_trees():
    trees = tree_fields(specdec_methods(quick=True, tree="on"))
    assert trees and all(nodes >= 2 for nodes in trees.values())


def test_tree_auto_leaves_auto_to_the_policy_beside_auto_held_to_chains():
    methods = specdec_methods(quick=True, tree="auto")
    assert "tree_nodes" not in methods[report.AUTO]  # unset: the coordinator's --trees auto decides
    assert tree_fields(methods) == {AUTO_CHAINS: 1}


def test_heads_adds_a_heads_row_only_when_the_target_serves_heads():
    from specdec.v1 import coordinator_pb2

    assert report.HEADS not in specdec_methods(quick=True)
    assert specdec_methods(quick=True, heads=True)[report.HEADS] == {"proposer": coordinator_pb2.PROPOSER_HEADS}


def test_methods_keep_target_only_and_auto_and_name_an_unknown_one():
    methods = specdec_methods(quick=True)
    chosen = select_methods(methods, "draft γ=4")
    assert list(chosen) == [report.TARGET_ONLY, report.AUTO, f"{report.DRAFT_PREFIX}4"]
    assert select_methods(methods, "") == methods
    with pytest.raises(SystemExit, match="no method specdec eagle"):
        select_methods(methods, "eagle")


def test_policy_sim_writes_its_figures(tmp_path, monkeypatch, capsys):
    """bench/policy_sim.py runs the real policy on simulated sessions (no model)."""
    from bench import policy_sim

    monkeypatch.setattr("sys.argv", ["policy_sim.py", "--seeds", "2", "--rounds", "12", "--useless-sessions", "3",
                                     "--useless-tokens", "48", "--out", str(tmp_path)])
    assert policy_sim.main() == 0
    data = json.loads((tmp_path / "policy_sim.json").read_text())
    for model in ("flat", "slope"):
        for kind in ("copy", "new"):
            row = data["results"][model][kind]
            assert row["tokens_per_cost"] > 0 and 0 <= row["lookup_rounds"] <= 12
    useless = data["useless_draft"]
    assert len(useless) == 9
    for row in useless:
        if row["draft_alpha"] == 0:  # a draft never accepted: plain decoding is the best there is
            assert row["first_tokens_per_cost"] <= 1.0 and row["later_tokens_per_cost"] <= 1.0
            # later sessions start from what the first learnt and share its probe clock
            assert row["later_draft_rounds"] < row["first_draft_rounds"]
    out = capsys.readouterr().out
    assert "tokens/cost" in out and "later sessions" in out
