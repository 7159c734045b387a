"""K/V chunks beyond one session (specdec/runtime/kv_tier.py): the pod's prefix cache and the
K/V store shared by replicas (--prefix-cache-bytes, --kv-store).

Float64 tiny models, chunks of 16 tokens. A session's chunks restored on another session or
another replica give the logits a prefill gives, exactly; chunks that are missing, corrupt or
another model's are never used; a store that is down costs nothing but the prefill; drafts a
call made ahead carries are never kept. End to end, a session moved to fresh replicas
continues with the tokens it would have produced where it was (greedy and seeded sampling).

Here the service tests; the other tiers' are in tests/unit/test_kv_tier.py and
tests/e2e/test_kv_tier.py.
"""

from __future__ import annotations

import random

import pytest
import redis
import torch

from specdec.config import TargetConfig
from specdec.runtime.engines import engine_from_config

CHUNK = 16


def make_engine(model: str, kv_store: str = "", prefix_cache_bytes: int = 0):
    return engine_from_config(TargetConfig(model=model, dtype="float64", kv_store=kv_store,
                                           prefix_cache_bytes=prefix_cache_bytes, kv_chunk_tokens=CHUNK))


def history(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def run(engine, session_id: str, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """A call with the whole history (prefix_len 0), as a resend or a new session sends it:
    (the last position's logits [1, vocab], tokens the forward ran)."""
    entry, feed = engine.begin(session_id, 0, 0, tokens)
    logits = engine.forward(session_id, entry, feed, 1)
    engine.keep_committed(entry, len(tokens))
    engine.finish(session_id)
    return logits, len(feed)


def flush(engine) -> None:
    assert engine.kv_tier.writer.flush(10)


def written_elsewhere(model: str, url: str, tokens: list[int]):
    """A replica that ran `tokens` and wrote their chunks to the store at `url`: (its engine, its
    logits) and a second, fresh replica of the same model on the same store."""
    here, there = make_engine(model, url), make_engine(model, url)
    logits, _ = run(here, "s", tokens)
    flush(here)
    return here, logits, there


@pytest.fixture
def namespace_db(redis_url):
    """The shared redis-server, emptied of chunks first (another test's chunks would be hits)."""
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter("specdec:kv:*"):
        client.delete(key)
    return redis_url


def test_a_session_moved_to_another_replica_restores_its_chunks(models, namespace_db):
    tokens = history(130)
    _, before, there = written_elsewhere(models["llama"]["target"], namespace_db, tokens)
    after, ran = run(there, "s", tokens)
    assert ran == 130 - 128
    assert torch.equal(before, after)
    assert there.kv_tier.counters.store_hits == 8
    assert there.kv_tier.store.stats().bytes_read <= 1.05 * 128 * there.kv_spec.bytes_per_token


def test_a_corrupt_chunk_ends_the_restore_there(models, namespace_db):
    tokens = history(70)
    here, expected, there = written_elsewhere(models["llama"]["target"], namespace_db, tokens)
    client = redis.Redis.from_url(namespace_db)
    third = "specdec:kv:" + here.kv_tier.keys(tokens)[2].hex()
    value = bytearray(client.get(third))
    value[-1] ^= 0x01  # one bit of the payload
    client.set(third, bytes(value))
    got, ran = run(there, "s", tokens)
    assert ran == 70 - 32  # chunks 0 and 1 restored, the rest prefilled
    assert torch.equal(got, expected)
    assert there.kv_tier.counters.rejected == 1


def test_another_models_chunks_are_never_used(models, namespace_db, tmp_path):
    """The same architecture and shapes, other weights: other keys, so nothing is found."""
    from specdec_cli import tiny

    other = str(tiny.build_model(tmp_path / "other", tiny.byte_level_tokenizer(), "llama", seed=99))
    target = models["llama"]["target"]
    writer = make_engine(target, namespace_db)
    tokens = history(70)
    run(writer, "s", tokens)
    flush(writer)
    reader = make_engine(other, namespace_db)
    expected, _ = run(make_engine(other), "s", tokens)
    got, ran = run(reader, "s", tokens)
    assert ran == 70 and torch.equal(got, expected)
    assert reader.kv_tier.counters.store_hits == 0 and reader.kv_tier.counters.store_misses == 1


def test_a_store_that_is_down_costs_only_the_prefill(models, own_redis):
    target = models["llama"]["target"]
    tokens = history(70)
    here = make_engine(target, own_redis.url)
    expected, _ = run(here, "s", tokens)
    flush(here)
    own_redis.stop()
    there = make_engine(target, own_redis.url)
    got, ran = run(there, "s", tokens)
    assert ran == 70 and torch.equal(got, expected)
    assert not there.kv_tier.store.healthy
    run(there, "t", tokens)  # its writes are dropped, the call is not failed


def test_the_chunk_counters_are_metrics(models, namespace_db):
    from specdec.metrics import Metrics

    engine = make_engine(models["llama"]["target"], namespace_db, prefix_cache_bytes=64 << 20)
    metrics = Metrics("target")
    metrics.watch_kv_chunks(engine.kv_tier.metrics)
    prompt = history(70)
    run(engine, "a", prompt)
    flush(engine)
    run(engine, "b", prompt)
    text = metrics.render().decode()
    assert "specdec_kv_restored_tokens_total 64.0" in text
    assert "specdec_kv_prefix_cache_hits_total 4.0" in text
    assert "specdec_kv_store_chunks_written_total 4.0" in text
    assert "specdec_kv_store_up 1.0" in text
    chunk_bytes = 4 * CHUNK * engine.kv_spec.bytes_per_token
    written = next(float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("specdec_kv_store_bytes_written_total "))
    assert chunk_bytes < written <= 1.05 * chunk_bytes


def test_the_kv_store_has_a_health_name_of_its_own(models, own_redis, monkeypatch):
    """A target service with --kv-store reports the store under the health name
    specdec.v1.KVStore: SERVING while Redis answers, NOT_SERVING once it stops. The service's own
    name stays SERVING (its calls prefill instead), so probes never take it out of rotation."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.rpc import grpc_server as rpc_server
    from target_service import server as target_server

    monkeypatch.setattr(rpc_server, "DEPENDENCY_CHECK_S", 0.1)
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=0, kv_store=own_redis.url,
                          kv_chunk_tokens=CHUNK)
    server, port, _ = target_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)

    def status(name: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

    def settles(name: str, wanted: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if status(name) == wanted:
                return True
            time.sleep(0.05)
        return False

    serving, down = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert settles("specdec.v1.KVStore", serving)
        own_redis.stop()
        assert settles("specdec.v1.KVStore", down)
        assert status("specdec.v1.TargetService") == serving and status("") == serving
        own_redis.start()
        assert settles("specdec.v1.KVStore", serving)
    finally:
        channel.close()
        server.stop(None).wait(10)
