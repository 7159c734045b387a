"""bench/speedup.py's rows per --tree setting (the suite itself runs real services: not here)."""

from __future__ import annotations

import pytest

from bench import report
from bench.speedup import AUTO_CHAINS, specdec_methods

pytestmark = pytest.mark.unit


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
