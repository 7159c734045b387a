"""Batching: concurrent sessions share forwards, and each session's output is IDENTICAL to what it
gets alone (float64 tiny models, real gRPC).

Here the e2e tests; the other tiers' are in tests/unit/test_batching.py and
tests/service/test_batching.py. The tier split shares one description: see tests/service/test_batching.py.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.cluster import Cluster
NO_BATCHING = {"max_batch_size": 1}
EAGER_BATCHING = {"batch_wait_ms": 20.0}  # wait long enough that concurrent rounds meet


# ---- end to end ---------------------------------------------------------------------------------

def _requests(sampled: bool) -> list[dict]:
    """Mixed prompt lengths, γ (0 = target only), lengths and seeds; some continue their session."""
    rng = random.Random(7)
    requests = []
    for i in range(10):
        request = dict(token_ids=[rng.randrange(1, 380) for _ in range(rng.choice([2, 5, 17, 40, 90]))],
                       max_new_tokens=rng.randrange(6, 30), num_speculative_tokens=i % 6, ignore_eos=True)
        if sampled:
            request.update(temperature=0.8, top_k=[None, 20][i % 2], top_p=[None, 0.9][i % 3 == 0], seed=100 + i)
        requests.append(request)
    return requests


def _conversation(cluster: Cluster, request: dict, delay_s: float) -> list[list[int]]:
    """A request, then a second turn on its session (the services roll back and continue)."""
    time.sleep(delay_s)  # sessions join while others are mid-generation
    first = cluster.complete(**request)
    turn = dict(request, token_ids=[11, 12, 13], max_new_tokens=request["max_new_tokens"] // 2 + 1,
                session_id=first.session_id)
    if "seed" in turn:
        turn["seed"] += 1000
    second = cluster.complete(**turn)
    return [list(first.token_ids), list(second.token_ids)]


@pytest.mark.parametrize("arch, sampled", [("llama", False), ("llama", True), ("gpt2", False), ("gpt2", True)])
def test_concurrent_sessions_equal_one_at_a_time(models, arch, sampled):
    paths = models[arch]
    requests = _requests(sampled)
    with Cluster(paths["draft"], paths["target"], draft=NO_BATCHING, target=NO_BATCHING) as alone:
        expected = [_conversation(alone, r, 0.0) for r in requests]
        assert max(alone.target_servicer.scheduler.batch_sizes) == 1
    with Cluster(paths["draft"], paths["target"], draft=EAGER_BATCHING, target=EAGER_BATCHING) as cluster:
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(_conversation, cluster, r, 0.05 * (i % 4)) for i, r in enumerate(requests)]
            got = [f.result(timeout=300) for f in futures]
        target_batches = cluster.target_servicer.scheduler.batch_sizes
        draft_batches = cluster.draft_servicer.scheduler.batch_sizes
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, (i, requests[i])
    # the comparison above is between batched and unbatched runs
    assert max(target_batches) > 1 and max(draft_batches) > 1, (target_batches, draft_batches)
