"""Long prefills finish: a prompt whose prefill outlasts the RPC deadline still completes.

The target prefills in chunks, each a separate task on its model worker. When the
coordinator's deadline passes, the chunks already run stay in the cache and the resend
(prefix_len 0, the full history) resumes from their longest common prefix instead of
starting again — so each attempt makes progress and the request completes, with the same
output as a run that never timed out. (On a call stream a call that reports progress is not
timed out at all: tests/e2e/test_call_deadlines.py. Unary calls report none, so they still time
out, and resume.)
"""

from __future__ import annotations

import random


from tests.cluster import Cluster
from tests.spies import slowed_model

PROMPT_TOKENS = 3000


def test_prefill_longer_than_the_rpc_timeout_completes(long_context_pair):
    draft, target = long_context_pair
    prompt = [random.Random(0).randrange(1, 380) for _ in range(PROMPT_TOKENS)]
    request = dict(token_ids=prompt, max_new_tokens=12, num_speculative_tokens=3, ignore_eos=True)
    with Cluster(draft, target, target={"prefill_chunk": 64}) as cluster:
        expected = cluster.complete(**request)
        assert expected.stats.target_retries == 0
    # an RPC deadline far below the prompt's prefill time (a slowed target, 3 s for the prompt)
    with Cluster(draft, target, target={"prefill_chunk": 64},
                 coordinator={"rpc_timeout_s": 0.15, "target_retry_s": 30, "rpc_transport": "unary"}) as cluster:
        with slowed_model(cluster.target_servicer, 0.001):
            response = cluster.complete(**request)
        tokens_run = cluster.target_servicer.engine.tokens_run
    assert list(response.token_ids) == list(expected.token_ids)
    assert response.stats.target_retries >= 1, "the prefill never outlasted the deadline: the test proves nothing"
    # the work was resumed, not redone: the prompt was run about once in all
    assert tokens_run < PROMPT_TOKENS + 200, tokens_run
