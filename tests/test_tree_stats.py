"""A token tree's outcome against its spine, and what the stats and the coordinator's metrics
count of tree rounds, on hand-built trees."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.stats import GenerationStats
from specdec.metrics import Metrics
from specdec.maths.tree import TokenTree, TreeOutcome, tree_outcome
from specdec.types import Source

pytestmark = pytest.mark.unit

#        root
#       /    \
#     n0(5)  n1(6)        n0 the draft's chain (first child), n1 an alternative
#     /  \      \
#  n2(7) n3(8)  n4(9)     n2 the chain again
#    |
#  n5(1)
TREE = TokenTree((5, 6, 7, 8, 9, 1), (0, 0, 1, 1, 2, 3))


def test_the_spine_follows_first_children():
    assert TREE.spine() == [0, 2, 5]
    assert TokenTree.chain([3, 4, 5]).spine() == [0, 1, 2]


@pytest.mark.parametrize("accepted, outcome", [
    ((0, 2, 5), TreeOutcome(3, 3, 0, 0)),  # the whole spine
    ((0, 2), TreeOutcome(3, 2, 0, 0)),     # n5 rejected: it has no siblings
    ((0, 3), TreeOutcome(3, 1, 1, 1)),     # n2 rejected, its first sibling n3 accepted
    ((1, 4), TreeOutcome(3, 0, 1, 1)),     # n0 rejected, n1 accepted and n4 under it
    ((0,), TreeOutcome(3, 1, 1, 0)),       # n2 rejected and n3 tried in vain
    ((), TreeOutcome(3, 0, 1, 0)),         # n0 and n1 both rejected
])
def test_tree_outcome(accepted, outcome):
    assert tree_outcome(TREE, accepted) == outcome


# TREE with prompt lookup's branch 2 3 grafted on: n6(2) under the root, n7(3) under it
GRAFTED = TokenTree(TREE.tokens + (2, 3), TREE.parents + (0, 7))


@pytest.mark.parametrize("accepted, outcome", [
    ((6, 7), TreeOutcome(3, 0, 1, 0)),  # n0 rejected, n1 tried in vain (a draft node), lookup's taken
    ((0, 3), TreeOutcome(3, 1, 1, 1)),  # as without the branch
    ((0, 2, 5), TreeOutcome(3, 3, 0, 0)),
])
def test_a_grafted_branch_is_not_the_drafts_alternative(accepted, outcome):
    assert tree_outcome(GRAFTED, accepted, draft_nodes=len(TREE)) == outcome


def test_stats_count_the_grafted_lookup_branch():
    stats = GenerationStats()
    stats.record_round(8, 2, Source.DRAFT, tree=GRAFTED, accepted_nodes=(6, 7), lookup_nodes=2)
    stats.record_round(8, 2, Source.DRAFT, tree=GRAFTED, accepted_nodes=(0, 3), lookup_nodes=2)
    assert (stats.tree_lookup_tokens, stats.tree_lookup_accepted_tokens) == (4, 2)
    assert stats.tree_branch_accepted_tokens == 2 + 1  # off the draft's chain: n6 n7, then n3
    # a spine leaf's grafted child: the spine stays the draft's own
    extended = TokenTree(TREE.tokens + (3,), TREE.parents + (6,))
    assert tree_outcome(extended, (0, 2, 5, 6), draft_nodes=len(TREE)) == TreeOutcome(3, 3, 0, 0)


def test_stats_count_tree_rounds_by_hand():
    stats = GenerationStats()
    stats.record_round(6, 3, Source.DRAFT, tree=TREE, accepted_nodes=(0, 2, 5))
    stats.record_round(6, 2, Source.DRAFT, tree=TREE, accepted_nodes=(1, 4))
    stats.record_round(6, 0, Source.DRAFT, tree=TREE, accepted_nodes=())
    stats.record_round(4, 2, Source.DRAFT)  # a chain round
    stats.generated_tokens = 3 + 1 + 2 + 1 + 0 + 1 + 2 + 1
    assert (stats.rounds, stats.draft_rounds, stats.tree_rounds) == (4, 4, 3)
    assert (stats.draft_tokens, stats.tree_draft_tokens) == (22, 18)
    assert (stats.accepted_tokens, stats.tree_accepted_tokens) == (7, 5)
    assert stats.tree_branch_accepted_tokens == 2  # n1 and n4: off the spine
    assert stats.tree_accepted_per_depth == [2, 2, 1]
    assert stats.accepted_per_position == [3, 3, 1]  # every round's path, chains included
    assert stats.tree_tokens_per_round == pytest.approx((5 + 3) / 3)
    assert stats.tokens_per_round == pytest.approx(11 / 4)
    data = stats.to_dict()
    assert data["tree_tokens_per_round"] == pytest.approx(8 / 3)
    merged = GenerationStats.from_dict(data).merged(stats)
    assert merged.tree_accepted_per_depth == [4, 4, 2] and merged.tree_rounds == 6
    assert GenerationStats().tree_tokens_per_round == 0.0


def scraped(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_count_tree_rounds_by_hand():
    metrics = Metrics("coordinator")
    metrics.record_round(Source.DRAFT, 6, 3, tree=True)
    metrics.record_round(Source.DRAFT, 6, 1, tree=True)
    metrics.record_round(Source.DRAFT, 4, 4)  # a chain round: not a tree's
    values = scraped(metrics)
    assert values["specdec_num_tree_drafts_total", ()] == 2
    assert values["specdec_num_tree_draft_tokens_total", ()] == 12
    per_depth = {dict(labels)["depth"]: v for (name, labels), v in values.items()
                 if name == "specdec_num_tree_accepted_tokens_per_depth_total"}
    assert per_depth == {"1": 2, "2": 1, "3": 1}
    assert values["specdec_tree_tokens_per_round_count", ()] == 2
    assert values["specdec_tree_tokens_per_round_sum", ()] == 4 + 2
    assert values["specdec_num_draft_tokens_total", (("proposer", "draft"),)] == 16
