"""Deadlines follow the work: a call to a model service is not abandoned for being long.

The target is slowed on purpose (tests/spies.py `slowed_model`: every forward sleeps per
token), the ordinary deadline (--rpc-timeout-s) is short. A prompt whose prefill takes several
times that deadline finishes without a single timeout, with the output of target-only decoding:
the target reports progress after each prefill chunk, and a call that is working gets its
deadline again from each report. A call that really runs out of time fails with
DEADLINE_EXCEEDED (not UNAVAILABLE), saying what it was doing and how long it ran, and its
replica, which answers its health check, is not marked failed for being slow.
"""

from __future__ import annotations

import random
import re
import time

import grpc
import pytest

from coordinator.sessions.deadlines import call_deadline_s
from tests.cluster import Cluster
from tests.spies import slowed_model

PROMPT_TOKENS = 3000
ORDINARY_S = 1.0  # --rpc-timeout-s of these tests
CHUNK = 64  # the target's --prefill-chunk


def _prompt(tokens: int) -> list[int]:
    return [random.Random(0).randrange(1, 380) for _ in range(tokens)]


def test_a_prefill_many_times_the_ordinary_deadline_finishes_without_a_timeout(long_context_pair):
    draft, target = long_context_pair
    request = dict(token_ids=_prompt(PROMPT_TOKENS), max_new_tokens=8, ignore_eos=True)
    # slow enough that the prefill outlasts even the deadline the call starts with, and each of
    # its 512-token chunks the ordinary deadline (only the heartbeat says the target is working)
    seconds_per_token = 1.2 * call_deadline_s(PROMPT_TOKENS, None, ORDINARY_S) / PROMPT_TOKENS
    assert seconds_per_token * 512 > ORDINARY_S
    with Cluster(draft, target, target={"prefill_chunk": 512},
                 coordinator={"rpc_timeout_s": ORDINARY_S, "target_retry_s": 0.0}) as cluster:
        with slowed_model(cluster.target_servicer, seconds_per_token):
            started = time.monotonic()
            response = cluster.complete(num_speculative_tokens=3, **request)
            took = time.monotonic() - started
        target_only = cluster.complete(num_speculative_tokens=0, **request)  # after: the prompt is cached
    assert took > 3 * ORDINARY_S and took > call_deadline_s(PROMPT_TOKENS, None, ORDINARY_S), (
        f"the prefill took {took:.1f} s: the test proves nothing")
    assert response.stats.target_retries == 0  # never abandoned, never resent
    assert list(response.token_ids) == list(target_only.token_ids)


@pytest.mark.parametrize("transport, says", [
    ("stream", r"ran \d+\.\d s, limit \d+\.\d s; \d+ of 299 tokens done$"),  # a chunk outlasts the deadline
    ("unary", r"ran \d+\.\d s, limit \d+\.\d s$"),  # no progress on a unary call
])
def test_a_call_that_runs_out_of_time_says_so(long_context_pair, transport, says):
    draft, target = long_context_pair
    prompt = _prompt(300)
    config = {"rpc_timeout_s": 0.3, "target_retry_s": 0.5, "rpc_transport": transport}
    with Cluster(draft, target, target={"prefill_chunk": CHUNK}, coordinator=config) as cluster:
        with slowed_model(cluster.target_servicer, 0.6 / CHUNK):  # 0.6 s a chunk
            with pytest.raises(grpc.RpcError) as failure:
                cluster.complete(token_ids=prompt, max_new_tokens=4, num_speculative_tokens=0)
            states = cluster.loop.run(_target_states(cluster))
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, failure.value
    message = failure.value.details()
    assert f"target service at 127.0.0.1:{cluster.target_port}" in message, message
    assert "(DEADLINE_EXCEEDED) on Verify: prefill of 300 tokens: " in message and re.search(says, message), message
    assert list(states.values()) == ["ready"], states  # slow, not down: never marked failed


async def _target_states(cluster: Cluster) -> dict[str, str]:
    pool = cluster.coordinator.round_loop.routes.targets
    return {address: replica.state for address, replica in pool._replicas.items()}
