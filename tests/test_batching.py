"""Batching: concurrent sessions share forwards, and each session's output is IDENTICAL to what it
gets alone (float64 tiny models, real gRPC).

End to end, many concurrent generations (mixed prompt lengths, mixed γ, greedy and seeded
sampling, continued sessions, sessions joining and leaving) are compared token for token with the
same requests run one at a time on services that never batch. At the service level, the model
worker is held while calls queue, so they run as one batch for certain: rollbacks of different
lengths, mixed γ, a cache miss and a bad request in one batch, each compared with the same call
run alone. The K/V buffers are checked against the DynamicCache path they replace.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from draft_service import server as draft_server
from specdec_cli import tiny
from specdec.config import DraftConfig, TargetConfig
from specdec.fingerprint import fingerprint
from specdec.runtime.kv_cache import SessionCaches
from specdec.runtime.loader import load_model
from specdec.runtime.torch.engine import TorchEngine
from specdec.runtime.session_kv import Row
from specdec.runtime.torch.kv_buffers import KVBuffer, grown_capacity
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.cluster import Cluster, _free_port
from tests.spies import held_worker

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
SAMPLED = common_pb2.SamplingParams(temperature=0.8, top_k=0, top_p=0.95)
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


@pytest.mark.e2e
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


# ---- one batch for certain, at the service level -------------------------------------------------

def _outcome(future) -> tuple:
    try:
        return ("ok", future.result(timeout=60))
    except grpc.RpcError as exc:
        return (exc.code(), exc.details())


def _history(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 380) for _ in range(rng.randrange(3, 60))]


@pytest.fixture(scope="module")
def target(models):
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=_free_port(), batch_wait_ms=5.0)
    server, port, servicer = target_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target_pb2_grpc.TargetServiceStub(channel), servicer
    channel.close()
    server.stop(None).wait()


@pytest.fixture(scope="module")
def draft(models):
    config = DraftConfig(model=models["llama"]["draft"], dtype="float64", port=_free_port(), batch_wait_ms=5.0,
                         max_queue=64)
    server, port, servicer = draft_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield draft_pb2_grpc.DraftServiceStub(channel), servicer
    channel.close()
    server.stop(None).wait()


def _q(drafts: list[int]) -> list[common_pb2.SparseDistribution]:
    """A valid proposal distribution per draft token (it holds the token)."""
    return [common_pb2.SparseDistribution(token_ids=[d, (d + 1) % 384, (d + 2) % 384], probs=[0.5, 0.3, 0.2])
            for d in drafts]


def _verify_requests(prefix: str, histories: list[list[int]], model, rng: random.Random
                     ) -> list[target_pb2.VerifyRequest]:
    """Per session: roll back 0..6 tokens, add 1-3 tokens, then 0-5 drafts: the target's own
    greedy continuation up to a position that varies, then a random token; greedy or sampled."""
    requests = []
    for i, history in enumerate(histories):
        keep = max(1, len(history) - (i * 2) % 7)
        new_tokens = [rng.randrange(1, 380) for _ in range(1 + i % 3)]
        gamma, agree = i % 6, i % 4
        drafts: list[int] = []
        with torch.inference_mode():
            while len(drafts) < gamma:
                if len(drafts) < agree:
                    logits = model(torch.tensor([history[:keep] + new_tokens + drafts])).logits[0, -1]
                    drafts.append(int(logits.argmax()))
                else:
                    drafts.append(rng.randrange(1, 380))
        sampling = GREEDY if i % 2 else SAMPLED
        requests.append(target_pb2.VerifyRequest(
            session_id=f"{prefix}{i}", prefix_len=keep, prefix_hash=fingerprint(history[:keep]),
            new_tokens=new_tokens, draft_tokens=drafts, draft_probs=_q(drafts) if sampling is SAMPLED else [],
            sampling=sampling, seed=40 + i))
    return requests


@pytest.mark.service
def test_one_verify_batch_equals_each_call_alone(target):
    stub, servicer = target
    rng = random.Random(3)
    histories = [_history(rng) for _ in range(7)]
    requests = _verify_requests("v", histories, servicer.engine.model, random.Random(4))
    for prefix in ("v", "alone-v"):
        for i, history in enumerate(histories):
            stub.Verify(target_pb2.VerifyRequest(session_id=f"{prefix}{i}", prefix_len=0, new_tokens=history,
                                                 sampling=GREEDY))
    miss = target_pb2.VerifyRequest(session_id="v-miss", prefix_len=2, prefix_hash=12345, new_tokens=[9],
                                    sampling=GREEDY)  # a wrong fingerprint: a cache miss
    stub.Verify(target_pb2.VerifyRequest(session_id="v-miss", prefix_len=0, new_tokens=[1, 2, 3], sampling=GREEDY))
    bad = target_pb2.VerifyRequest(session_id="v-bad", prefix_len=0, new_tokens=[1], draft_tokens=[2],
                                   draft_probs=[common_pb2.SparseDistribution(token_ids=[2], probs=[float("nan")])],
                                   sampling=SAMPLED)
    before = servicer.scheduler.batch_sizes.copy()
    with held_worker(servicer, queued=len(requests) + 1):
        futures = [stub.Verify.future(r, timeout=60) for r in requests + [miss]]
        bad_outcome = _outcome(stub.Verify.future(bad, timeout=60))
    outcomes = [_outcome(f) for f in futures]
    assert servicer.scheduler.batch_sizes - before == {len(requests) + 1: 1}, "not one batch"
    assert bad_outcome[0] == grpc.StatusCode.INVALID_ARGUMENT and "finite" in bad_outcome[1]
    assert outcomes[-1][0] == grpc.StatusCode.FAILED_PRECONDITION and "cache miss" in outcomes[-1][1]
    for request, (status, got) in zip(requests, outcomes[:-1]):
        assert status == "ok", got
        request.session_id = "alone-" + request.session_id
        alone = stub.Verify(request)  # a batch of one
        assert got == alone, request.session_id
    assert len({o[1].num_accepted for o in outcomes[:-1]}) > 2, "rollbacks of one length only: a weak test"


@pytest.mark.service
def test_one_propose_batch_equals_each_call_alone(draft):
    stub, servicer = draft
    rng = random.Random(5)
    histories = [_history(rng) for _ in range(8)]
    requests = []
    for i, history in enumerate(histories):
        keep = max(1, len(history) - i % 5)
        requests.append(draft_pb2.ProposeRequest(
            session_id=f"p{i}", prefix_len=keep, prefix_hash=fingerprint(history[:keep]),
            new_tokens=[rng.randrange(1, 380) for _ in range(1 + i % 4)], num_speculative_tokens=1 + i % 6,
            sampling=GREEDY if i % 3 == 0 else SAMPLED, seed=70 + i))
    for prefix in ("p", "alone-p"):
        for i, history in enumerate(histories):
            stub.Propose(draft_pb2.ProposeRequest(session_id=f"{prefix}{i}", prefix_len=0, new_tokens=history,
                                                  num_speculative_tokens=1, sampling=GREEDY))
    miss = draft_pb2.ProposeRequest(session_id="p-none", prefix_len=4, prefix_hash=1, new_tokens=[3],
                                    num_speculative_tokens=2, sampling=GREEDY)
    before = servicer.scheduler.batch_sizes.copy()
    with held_worker(servicer, queued=len(requests) + 1):
        futures = [stub.Propose.future(r, timeout=60) for r in requests + [miss]]
    outcomes = [_outcome(f) for f in futures]
    assert servicer.scheduler.batch_sizes - before == {len(requests) + 1: 1}, "not one batch"
    assert outcomes[-1][0] == grpc.StatusCode.FAILED_PRECONDITION
    for request, (status, got) in zip(requests, outcomes[:-1]):
        assert status == "ok", got
        assert len(got.draft_tokens) == request.num_speculative_tokens  # smaller γ left the batch early
        request.session_id = "alone-" + request.session_id
        assert got == stub.Propose(request), request.session_id


@pytest.mark.service
def test_queued_calls_hold_their_place_in_the_bounded_queue(models):
    config = DraftConfig(model=models["llama"]["draft"], dtype="float64", port=_free_port(), max_queue=3)
    server, port, servicer = draft_server.start(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            request = dict(prefix_len=0, new_tokens=[4, 5, 6], num_speculative_tokens=3, sampling=GREEDY)
            with held_worker(servicer, queued=3):
                futures = [stub.Propose.future(draft_pb2.ProposeRequest(session_id=f"q{i}", **request), timeout=60)
                           for i in range(3)]
                deadline = time.monotonic() + 30
                while servicer.worker.queue_depth < 3:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Propose(draft_pb2.ProposeRequest(session_id="q-over", **request), timeout=5)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            results = [f.result(timeout=60) for f in futures]
            assert len({tuple(r.draft_tokens) for r in results}) == 1  # same input, same greedy drafts
            assert servicer.scheduler.batch_sizes == {3: 1}
            assert servicer.worker.queue_depth == 0
    finally:
        server.stop(None).wait()


# ---- the K/V buffers ----------------------------------------------------------------------------

@pytest.fixture
def engines(models):
    """The same model with K/V buffers and with the DynamicCache fallback."""
    loaded = load_model(models["llama"]["target"], "float64")
    buffered = TorchEngine(loaded, SessionCaches(64, 1 << 30), 16)
    fallback = TorchEngine(loaded, SessionCaches(64, 1 << 30), 16)
    fallback.kv_spec = None
    assert buffered.kv_spec is not None
    return buffered, fallback


@pytest.mark.unit
def test_batched_buffers_match_the_dynamic_cache_with_rollbacks(engines):
    buffered, fallback = engines
    rng = random.Random(9)
    for step in range(12):
        rows = {r: [] for r in engines}
        for sid in (f"s{i}" for i in range(6)):
            if rng.random() < 0.3:
                continue  # this session sits the step out (others join and leave)
            tokens = [rng.randrange(1, 380) for _ in range(rng.choice([1, 2, 5, 30]))]
            keep = rng.randrange(1, len(tokens) + 1)
            rollback = rng.randrange(0, 4)
            for engine in engines:
                entry = engine.caches.get(sid)
                if entry is None:
                    entry = engine.new_entry()
                    engine.caches.put(sid, entry)
                entry.crop(max(0, len(entry) - rollback))
                rows[engine].append(Row(sid, entry, tokens, keep))
        if not rows[buffered]:
            continue
        for got, expected in zip(buffered.forward_batch(rows[buffered]), fallback.forward_batch(rows[fallback])):
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    # the byte total is kept call by call; it equals a scan of every session
    caches = buffered.caches
    assert caches.total_bytes() == sum(e.nbytes() for e in caches._entries.values()) > 0
    caches.release("s0")
    caches.max_sessions = 2
    caches.enforce_limits()
    assert len(caches) == 2 and caches.total_bytes() == sum(e.nbytes() for e in caches._entries.values())


@pytest.mark.unit
def test_buffer_growth_keeps_memory_near_the_kv_size(engines):
    buffered, _ = engines
    spec = buffered.kv_spec
    assert spec.bytes_per_token == 2 * 2 * 2 * 8 * 8  # layers × (K, V) × kv heads × head dim × float64
    for needed in (1, 17, 300, 1000, 4000, 10_000):
        capacity = grown_capacity(0, needed)
        assert needed <= capacity <= needed + max(8, needed / 16 + 4), (needed, capacity)
        assert capacity % 4 == 0 and grown_capacity(capacity, needed) == capacity  # no growth needed
    buffer = KVBuffer(spec)
    buffer.reserve(5, 0)
    buffer.data[:, :, :, :5] = 7.0
    buffer.reserve(2000, 5)  # grows, keeping the valid part
    assert buffer.capacity >= 2000 and bool((buffer.data[:, :, :, :5] == 7.0).all())
    assert buffer.nbytes() == buffer.capacity * spec.bytes_per_token


@pytest.mark.unit
def test_sliding_window_models_fall_back_to_the_dynamic_cache(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    tokenizer = tiny.byte_level_tokenizer()
    config = tiny.model_config("qwen2", len(tokenizer), tokenizer.eos_token_id)
    config.use_sliding_window, config.sliding_window = True, 8
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        engine = TorchEngine(load_model(str(tmp_path), "float64"), SessionCaches(8, 1 << 30), 4)
    assert engine.kv_spec is None
    assert "DynamicSlidingWindowLayer" in caplog.text and "no batched forwards" in caplog.text
    rows = []
    for sid, tokens in (("a", [5, 6, 7]), ("b", [8] * 12)):
        entry = engine.new_entry()
        engine.caches.put(sid, entry)
        rows.append(Row(sid, entry, tokens, 2))
    logits = engine.forward_batch(rows)  # still one call for both rows, run row by row
    assert [tuple(x.shape) for x in logits] == [(2, 384), (2, 384)]
    assert len(engine.caches.get("b")) == 12


@pytest.mark.unit
def test_start_up_check_catches_a_model_that_batches_wrongly(engines):
    buffered, _ = engines
    assert buffered._batches_agree()
    forward = buffered.model.model.forward

    def positions_ignored(*args, **kwargs):  # as a model computing positions from the cache would
        kwargs.pop("position_ids", None)
        return forward(*args, **kwargs)

    buffered.model.model.forward = positions_ignored
    try:
        assert not buffered._batches_agree()
    finally:
        buffered.model.model.forward = forward
