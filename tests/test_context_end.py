"""Rounds at the end of the model context: a 64-token context, a 50-token prompt and 30 new
tokens asked for. Target-only decoding stops after 14 tokens with the finish reason
`context_length`; chains, token trees (whose nodes outnumber the room left) and trees with
prompt lookup's branches grafted on must stop there too, with the target's own tokens — never
a rejected call (a tree's positions go only as deep as the tree, whatever its node count)."""

from __future__ import annotations

import pytest

from specdec_cli import tiny
from specdec.v1 import common_pb2, coordinator_pb2
from tests.cluster import Cluster
from tests.test_e2e_trees import believe_draft_and_lookup
from tests.test_sources import target_only

pytestmark = pytest.mark.e2e

CONTEXT, NEW_TOKENS = 64, 30
PROMPT = ([3, 7, 5, 9, 2] * 10)  # 50 tokens that repeat: prompt lookup finds matches
ROOM = CONTEXT - len(PROMPT)  # 14 tokens fit


@pytest.fixture(scope="module")
def short_context(tmp_path_factory) -> dict[str, str]:
    """A 12-word target and an unrelated draft whose context is 64 tokens."""
    root = tmp_path_factory.mktemp("context64")
    tokenizer = tiny.word_tokenizer(12)
    return {
        "target": str(tiny.build_model(root / "target", tokenizer, "llama", seed=21, init_std=0.15, context=CONTEXT)),
        "draft": str(tiny.build_model(root / "draft", tokenizer, "llama", seed=24, layers=1, init_std=0.3,
                                      context=CONTEXT)),
    }


@pytest.fixture(scope="module")
def expected(short_context) -> list[int]:
    return target_only(short_context["target"], PROMPT, ROOM)


def _check(response, expected: list[int]) -> None:
    assert response.finish_reason == common_pb2.FINISH_REASON_CONTEXT_LENGTH
    assert list(response.token_ids) == expected


@pytest.mark.parametrize("draft_kind", ["identical", "unrelated"])
def test_chains_and_trees_stop_at_the_context_end(short_context, expected, draft_kind):
    """The target as its own draft takes every node of its spine, so rounds reach the end of the
    context as deep as they can; an unrelated draft stops anywhere."""
    target = short_context["target"]
    draft = target if draft_kind == "identical" else short_context["draft"]
    with Cluster(draft, target) as cluster:
        plain = cluster.complete(token_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                 proposer=coordinator_pb2.PROPOSER_NONE)
        _check(plain, expected)
        for gamma, nodes in ((1, 0), (4, 0), (1, 4), (2, 8), (3, 12), (4, 12)):
            response = cluster.complete(token_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                        proposer=coordinator_pb2.PROPOSER_DRAFT, num_speculative_tokens=gamma,
                                        tree_nodes=nodes)
            _check(response, expected)
            if nodes:
                assert response.stats.tree_rounds > 0, (gamma, nodes)


def test_trees_with_lookup_branches_stop_at_the_context_end(short_context, expected):
    """Adaptive `auto` tree rounds with prompt lookup's continuations grafted on (the prompt
    repeats, so they are long) near the end of the context."""
    with Cluster(short_context["draft"], short_context["target"], coordinator={"draft_cost_ratio": 0.1}) as cluster:
        believe_draft_and_lookup(cluster)
        grafted = 0
        for nodes in (4, 8, 12):
            response = cluster.complete(token_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                        tree_nodes=nodes, proposer=coordinator_pb2.PROPOSER_AUTO)
            _check(response, expected)
            grafted += response.stats.tree_lookup_tokens
        assert grafted > 0
