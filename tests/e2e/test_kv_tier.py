"""K/V chunks beyond one session (specdec/runtime/kv_tier.py): the pod's prefix cache and the
K/V store shared by replicas (--prefix-cache-bytes, --kv-store).

Here the e2e tests; the other tiers' are in tests/unit/test_kv_tier.py and
tests/service/test_kv_tier.py. The tier split shares one description: see tests/service/test_kv_tier.py.
"""

from __future__ import annotations

import pytest

from tests.cluster import Cluster
from tests.e2e.test_sources import proposer, target_only
from tests.service.test_kv_tier import CHUNK, history, namespace_db


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_a_session_moved_to_fresh_replicas_continues_exactly(models, namespace_db, sampled):
    """Turn 1 on one deployment; turn 2 on fresh draft and target replicas that restore the
    session's chunks from the store, and on fresh replicas without a store (which re-prefill):
    the same tokens. Greedy, they are the target's alone."""
    paths = models["llama"]
    services = {"kv_store": namespace_db, "kv_chunk_tokens": CHUNK, "prefix_cache_bytes": 0}
    coordinator = {"session_store": namespace_db}
    fields = dict(max_new_tokens=24, ignore_eos=True, proposer=proposer("draft"), num_speculative_tokens=3)
    if sampled:
        fields.update(temperature=0.9, seed=7)
    prompt = history(90, seed=3)
    with Cluster(paths["draft"], paths["target"], coordinator=coordinator, draft=services,
                 target=services) as first:
        sessions = [first.complete(token_ids=prompt, **fields) for _ in range(2)]
        assert list(sessions[0].token_ids) == list(sessions[1].token_ids)
        first.target_servicer.engine.kv_tier.writer.flush(10)
        first.draft_servicer.engine.kv_tier.writer.flush(10)
    turn = [4, 5, 6]
    continued = []
    for session, store in zip(sessions, (namespace_db, "")):
        with Cluster(paths["draft"], paths["target"], coordinator=coordinator,
                     draft={**services, "kv_store": store}, target={**services, "kv_store": store}) as fresh:
            response = fresh.complete(session_id=session.session_id, token_ids=turn, **fields)
            continued.append(list(response.token_ids))
            stats = response.stats
            # the fresh replicas were sent the whole history; with the store they ran only the
            # part past its last full chunk
            history_len = len(prompt) + len(session.token_ids) + len(turn)
            assert stats.target_prefill_tokens == history_len
            full_chunks = (history_len - 1) // CHUNK * CHUNK
            if store:
                assert stats.target_restored_tokens >= full_chunks - CHUNK  # written up to the last call
                assert stats.draft_restored_tokens >= full_chunks - 2 * CHUNK
            else:
                assert stats.target_restored_tokens == stats.draft_restored_tokens == 0
    assert continued[0] == continued[1]
    if not sampled:
        full = prompt + list(sessions[0].token_ids) + turn
        assert continued[0] == target_only(paths["target"], full, 24)


def test_requests_share_a_prompt_prefix_unless_salted(models):
    """Through the services: a second request with the same long prompt restores its chunks on
    both tiers (the stats say how many), a request with another cache_salt does not, and the
    output is the same every time."""
    import grpc

    paths = models["llama"]
    services = {"kv_chunk_tokens": CHUNK}
    prompt = history(80, seed=5)
    fields = dict(token_ids=prompt, max_new_tokens=12, ignore_eos=True, proposer=proposer("draft"),
                  num_speculative_tokens=3)
    with Cluster(paths["draft"], paths["target"], draft=services, target=services) as cluster:
        first = cluster.complete(**fields)
        again = cluster.complete(**fields)
        salted = cluster.complete(cache_salt="tenant-b", **fields)
        for response in (first, again, salted):
            assert list(response.token_ids) == target_only(paths["target"], prompt, 12)
        assert first.stats.target_restored_tokens == first.stats.draft_restored_tokens == 0
        assert again.stats.target_restored_tokens == again.stats.draft_restored_tokens == 64
        assert salted.stats.target_restored_tokens == salted.stats.draft_restored_tokens == 0
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(cache_salt="x" * 257, **fields)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_salt must be at most 256 characters" in info.value.details()
