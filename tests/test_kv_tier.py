"""K/V chunks beyond one session (specdec/runtime/kv_tier.py): the pod's prefix cache and the
K/V store shared by replicas (--prefix-cache-bytes, --kv-store).

Float64 tiny models, chunks of 16 tokens. A session's chunks restored on another session or
another replica give the logits a prefill gives, exactly; chunks that are missing, corrupt or
another model's are never used; a store that is down costs nothing but the prefill; drafts a
call made ahead carries are never kept. End to end, a session moved to fresh replicas
continues with the tokens it would have produced where it was (greedy and seeded sampling).
"""

from __future__ import annotations

import random

import pytest
import redis
import torch

from specdec.config import TargetConfig
from specdec.runtime.engines import engine_from_config
from tests.cluster import Cluster
from tests.test_sources import proposer, target_only

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


@pytest.mark.unit
def test_sessions_sharing_a_prefix_prefill_it_once(models):
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=64 << 20)
    prompt = history(100)
    first, ran_first = run(engine, "a", prompt)
    second, ran_second = run(engine, "b", prompt)
    assert ran_first == 100
    assert ran_second == 100 - 96  # six chunks restored; the last token always runs
    assert torch.equal(first, second)
    assert engine.kv_tier.counters.cache_hits == 6 and engine.kv_tier.counters.restored_tokens == 96
    # a prompt that shares only its first two chunks restores those two
    other = prompt[:40] + history(60, seed=1)
    expected, _ = run(make_engine(models["llama"]["target"]), "x", other)
    got, ran = run(engine, "c", other)
    assert ran == 100 - 32 and torch.equal(got, expected)


@pytest.mark.unit
def test_the_prefix_cache_stays_within_its_budget(models):
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=1)  # smaller than one chunk
    prompt = history(40)
    run(engine, "a", prompt)
    _, ran = run(engine, "b", prompt)
    assert ran == 40 and engine.kv_tier.cache.nbytes == 0


@pytest.mark.unit
def test_drafts_of_a_call_made_ahead_are_never_kept(models):
    """Only the committed history's chunks are kept: a session whose last 20 tokens are drafts
    keeps the chunks that end before them."""
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=64 << 20)
    tokens = history(70)
    entry, feed = engine.begin("a", 0, 0, tokens)
    engine.forward("a", entry, feed, 1)
    engine.keep_committed(entry, 50)
    assert engine.kv_tier.counters.kept_chunks == 3  # chunks [0, 48): the one to 64 holds drafts
    _, feed_b = engine.begin("b", 0, 0, tokens)
    assert len(feed_b) == 70 - 48


@pytest.mark.service
def test_a_session_moved_to_another_replica_restores_its_chunks(models, namespace_db):
    tokens = history(130)
    _, before, there = written_elsewhere(models["llama"]["target"], namespace_db, tokens)
    after, ran = run(there, "s", tokens)
    assert ran == 130 - 128
    assert torch.equal(before, after)
    assert there.kv_tier.counters.store_hits == 8
    assert there.kv_tier.store.stats().bytes_read <= 1.05 * 128 * there.kv_spec.bytes_per_token


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.e2e
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


@pytest.mark.unit
def test_a_different_cache_salt_shares_nothing(models):
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=64 << 20)
    prompt = history(70)
    entry, feed = engine.begin("a", 0, 0, prompt, "tenant-a")
    engine.forward("a", entry, feed, 1)
    engine.keep_committed(entry, len(prompt), "tenant-a")
    assert len(engine.begin("b", 0, 0, prompt, "tenant-b")[1]) == 70  # another tenant: nothing
    assert len(engine.begin("c", 0, 0, prompt)[1]) == 70              # no salt: nothing
    assert len(engine.begin("d", 0, 0, prompt, "tenant-a")[1]) == 70 - 64
    assert engine.take_restored("d") == 64 and engine.take_restored("d") == 0


@pytest.mark.e2e
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


@pytest.mark.service
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


@pytest.mark.unit
def test_engines_that_cannot_cut_chunks_say_so_at_start_up(models, tmp_path, caplog):
    """A DynamicCache model (sliding-window layers) and the llama.cpp engine keep no chunks, and
    their services say so when they start, rather than taking --kv-store silently."""
    from transformers import AutoModelForCausalLM

    from specdec_cli import tiny
    from tests.gguf_writer import write_llama_gguf

    tokenizer = tiny.byte_level_tokenizer()
    config = tiny.model_config("qwen2", len(tokenizer), tokenizer.eos_token_id)
    config.use_sliding_window, config.sliding_window = True, 8
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "sliding")
    tokenizer.save_pretrained(tmp_path / "sliding")
    with caplog.at_level("WARNING"):
        engine = make_engine(str(tmp_path / "sliding"), "memory://", prefix_cache_bytes=1 << 20)
    assert engine.kv_tier is None
    assert "no prefix cache or K/V store" in caplog.text and "DynamicCache" in caplog.text
    caplog.clear()
    gguf = write_llama_gguf(models["llama"]["target"], tmp_path / "target.gguf")
    with caplog.at_level("WARNING"):
        llama = engine_from_config(TargetConfig(model=str(gguf), backend="llama.cpp", kv_store="memory://",
                                                kv_cache_tokens=256))
    try:
        assert llama.kv_tier is None
        assert "no K/V store on the llama.cpp backend" in caplog.text
    finally:
        llama.close()


@pytest.mark.service
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
