"""What switching source costs auto, spread over the tokens a request has left: the draft
catching up on history it lacks (a new session's prompt, the tokens of rounds it did not propose),
and the plain round that reads the target's heads before they can propose. Without services:
the pure formula, the cost model's catch-up fit, the planner's choices under pinned costs, and
one round loop through real services that learns the catch-up's cost.

Here the e2e tests; the other tiers' are in tests/unit/test_switch_costs.py.
"""

from __future__ import annotations

from specdec.types import Source
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster


def test_the_round_loop_learns_the_catch_up_from_the_drafts_calls(models):
    """A request that calls the draft on a new session's prompt measures the catch-up (once the
    draft's steps are measured); the draft then holds the history, and its rounds are plain."""
    request = dict(max_new_tokens=12, ignore_eos=True, proposer=coordinator_pb2.PROPOSER_DRAFT,
                   num_speculative_tokens=3)
    with Cluster(models["llama"]["draft"], models["llama"]["target"]) as cluster:
        loop = cluster.coordinator.round_loop
        costs = loop.speculation.estimates(loop.speculation.draft_model).costs
        cluster.complete(prompt="def fibonacci(n):", **request)  # its first call is unmeasured: no step fit yet
        assert costs.propose[Source.DRAFT].w > 0 and costs.catch_up.w == 0
        response = cluster.complete(prompt="class Stack:\n    def __init__(self):\n        self.items = []\n", **request)
        assert costs.catch_up.w == 1 and costs.catch_up.sx >= len("class Stack:")  # byte-level: a token a byte
        assert costs.relative_catch_up(100) > 0 and response.stats.draft_rounds > 1
