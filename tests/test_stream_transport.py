"""Propose and Verify over call streams (ProposeStream / VerifyStream, the coordinator's default
transport) against the same calls as unary RPCs: same output, same errors, same batching; a
stream that breaks fails its calls like a dead server and is opened anew; a server without the
stream methods gets unary calls. Real servers on loopback, tiny float64 models."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.sessions.clients import DraftClient, TargetClient
from specdec import errors
from specdec.config import DraftConfig, TargetConfig
from specdec.fingerprint import fingerprint
from specdec.rpc.grpc_server import build_aio_server
from specdec.types import SamplingParams, SparseDist
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from draft_service import server as draft_server
from target_service import server as target_server
from tests.cluster import Cluster, LoopThread, _free_port
from tests.spies import held_worker

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
MB16 = 16 << 20


class MethodLog(grpc.aio.ServerInterceptor):
    """The specdec.v1 methods called, one entry per RPC (a call stream counts once)."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith("/specdec.v1."):
            self.methods.append(handler_call_details.method.rsplit("/", 1)[-1])
        return await continuation(handler_call_details)

    def take(self) -> list[str]:
        methods, self.methods = self.methods, []
        return methods


async def queued(servicer, n: int) -> None:
    """Until n calls wait for the model worker."""
    deadline = time.monotonic() + 30
    while servicer.worker.queue_depth < n:
        assert time.monotonic() < deadline, "the calls never queued"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def run():
    """Run a coroutine on one event loop for the whole module (gRPC aio clients outlive none)."""
    thread = LoopThread()
    yield thread.run
    thread.close()


def start_target(models, port: int = 0, **fields):
    log = MethodLog()
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=port or _free_port(),
                          **{"batch_wait_ms": 5.0, **fields})
    server, port, servicer = target_server.start(config, [log])
    return server, port, servicer, log


@pytest.fixture(scope="module")
def target(models):
    server, port, servicer, log = start_target(models, max_queue=8)
    yield f"127.0.0.1:{port}", servicer, log
    server.stop(None).wait()


@pytest.fixture(scope="module")
def draft(models):
    log = MethodLog()
    config = DraftConfig(model=models["llama"]["draft"], dtype="float64", port=_free_port(), batch_wait_ms=5.0)
    server, port, servicer = draft_server.start(config, [log])
    yield f"127.0.0.1:{port}", servicer, log
    server.stop(None).wait()


def _verify(client: TargetClient, sid: str, prefix: list[int], new: list[int], drafts=(), params=GREEDY,
            probs=None, **kw):
    """client.verify with the fingerprint of `prefix` (the tokens the service is assumed to hold)."""
    dists = probs if probs is not None else [SparseDist((d,), (1.0,)) for d in drafts]
    return client.verify(sid, len(prefix), fingerprint(prefix) if prefix else 0, list(new), list(drafts),
                         dists, params, 7, **kw)


async def _failure(call) -> errors.SpecdecError:
    with pytest.raises(errors.SpecdecError) as info:
        await call
    return info.value


# ---- through the coordinator -----------------------------------------------------------------

def _conversations(cluster: Cluster) -> list[list[int]]:
    """Greedy generations with draft rounds, a continued session, and a continued session whose
    KV caches the services dropped in between (a cache miss, answered by resending)."""
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}"))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.draft_port}"))
    out = []
    for i, prompt in enumerate(([3, 7, 5, 2], [9, 4, 1, 2, 9, 4], [11, 12])):
        first = cluster.complete(token_ids=prompt, max_new_tokens=20, num_speculative_tokens=2 + i,
                                 ignore_eos=True)
        out.append(list(first.token_ids))
        if i == 2:  # the services lose the session: the next turn meets a cache miss
            for stub, request in ((target, target_pb2.TargetServiceReleaseRequest),
                                  (draft, draft_pb2.DraftServiceReleaseRequest)):
                assert stub.Release(request(session_id=first.session_id), timeout=10).released
        second = cluster.complete(token_ids=[5, 6], max_new_tokens=12, session_id=first.session_id,
                                  num_speculative_tokens=3, ignore_eos=True)
        out.append(list(second.token_ids))
        if i == 2:
            assert second.stats.cache_misses >= 1
    return out


@pytest.mark.e2e
def test_greedy_output_is_the_same_over_streams_and_unary_calls(models, run):
    outputs, methods = {}, {}
    for transport in ("stream", "unary"):
        log = MethodLog()
        with Cluster(models["llama"]["draft"], models["llama"]["target"], interceptors=[log],
                     coordinator={"rpc_transport": transport}) as cluster:
            log.take()  # start-up's model info
            outputs[transport] = _conversations(cluster)
            methods[transport] = log.take()
    assert outputs["stream"] == outputs["unary"]
    stream, unary = methods["stream"], methods["unary"]
    assert stream.count("ProposeStream") == 1 and stream.count("VerifyStream") == 1, stream
    assert "Propose" not in stream and "Verify" not in stream
    assert "ProposeStream" not in unary and unary.count("Verify") > 6 and "Propose" in unary


# ---- the call stream of one client ---------------------------------------------------------

@pytest.mark.service
def test_concurrent_calls_of_many_sessions_share_one_stream_and_one_batch(target, run):
    address, servicer, log = target
    histories = [[(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(6)]

    async def scenario():
        log.take()
        streamed, unary = (TargetClient(address, 30, MB16, transport=t) for t in ("stream", "unary"))
        for prefix, client in (("c", streamed), ("alone-c", unary)):
            for i, history in enumerate(histories):
                await _verify(client, f"{prefix}{i}", [], history)
        calls = [_verify(streamed, f"c{i}", h, [i + 1], drafts=[i + 2, i + 3][:i % 3],
                         params=GREEDY if i % 2 else SAMPLED)
                 for i, h in enumerate(histories)]
        before = servicer.scheduler.batch_sizes.copy()
        with held_worker(servicer):
            tasks = [asyncio.ensure_future(c) for c in calls]
            await queued(servicer, len(tasks))
        got = await asyncio.gather(*tasks)
        assert servicer.scheduler.batch_sizes - before == {len(tasks): 1}, "not one batch"
        for i, h in enumerate(histories):
            alone = await _verify(unary, f"alone-c{i}", h, [i + 1], drafts=[i + 2, i + 3][:i % 3],
                                  params=GREEDY if i % 2 else SAMPLED)
            assert got[i] == alone
        await streamed.close()
        await unary.close()

    run(scenario())
    methods = log.take()
    assert methods.count("VerifyStream") == 1 and methods.count("Verify") == 2 * len(histories)


@pytest.mark.service
def test_bad_request_gets_the_unary_error_and_the_stream_goes_on(target, run):
    address, servicer, log = target

    async def scenario():
        streamed, unary = (TargetClient(address, 30, MB16, transport=t) for t in ("stream", "unary"))
        for client in (streamed, unary):
            await _verify(client, "b", [], [1, 2, 3, 4, 5])
        nan = [SparseDist((2,), (float("nan"),))]
        bad = [await _failure(_verify(c, "b", [1, 2, 3, 4, 5], [6], drafts=[2], params=SAMPLED, probs=nan))
               for c in (streamed, unary)]
        assert type(bad[0]) is type(bad[1]) is errors.InvalidArgument
        assert str(bad[0]) == str(bad[1]) and "finite" in str(bad[0])
        assert bad[0].__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
        stream = streamed.verify_stream._stream
        # a wrong fingerprint: a cache miss that says how many tokens the service holds
        misses = [await _failure(_verify(c, "b", [1, 2, 9], [6])) for c in (streamed, unary)]
        assert type(misses[0]) is type(misses[1]) is errors.CacheMiss
        assert (misses[0].session_id, misses[0].held, misses[0].assumed) == ("b", 5, 3)
        assert str(misses[0]) == str(misses[1])
        # the stream still serves, and it is the same stream
        verdict = await _verify(streamed, "b", [], [1, 2, 3, 4, 5, 6])
        assert verdict.cached_len == 6 and streamed.verify_stream._stream is stream
        await streamed.close()
        await unary.close()

    run(scenario())


@pytest.mark.service
def test_a_full_queue_answers_resource_exhausted_with_its_retry_hint(target, run):
    address, servicer, _ = target

    async def scenario():
        streamed, unary = (TargetClient(address, 30, MB16, transport=t) for t in ("stream", "unary"))
        with held_worker(servicer):
            tasks = [asyncio.ensure_future(_verify(streamed, f"q{i}", [], [4, 5, 6]))
                     for i in range(servicer.worker.max_queue)]
            await queued(servicer, servicer.worker.max_queue)
            over = [await _failure(_verify(c, "q-over", [], [4, 5, 6])) for c in (streamed, unary)]
        await asyncio.gather(*tasks)
        assert type(over[0]) is type(over[1]) is errors.ResourceExhausted
        assert str(over[0]).split("retry in")[0] == str(over[1]).split("retry in")[0]
        trailers = [dict(e.__cause__.trailing_metadata()) for e in over]
        assert "retry-after-ms" in trailers[0] and "retry-after-ms" in trailers[1]
        await streamed.close()
        await unary.close()

    run(scenario())


@pytest.mark.service
def test_a_call_whose_deadline_passed_while_queued_is_dropped(target, run):
    address, servicer, _ = target

    async def scenario():
        client = TargetClient(address, 0.3, MB16)  # rpc timeout 0.3 s
        channel = grpc.aio.insecure_channel(address)
        stream = target_pb2_grpc.TargetServiceStub(channel).VerifyStream()
        request = target_pb2.VerifyRequest(session_id="late-raw", prefix_len=0, new_tokens=[1, 2],
                                           sampling=common_pb2.SamplingParams(temperature=0.0))
        before = servicer.scheduler.batch_sizes.copy()
        with held_worker(servicer):
            await stream.write(target_pb2.VerifyStreamRequest(call_id=41, request=request, timeout_ms=200))
            late = asyncio.ensure_future(_failure(_verify(client, "late", [], [1, 2])))
            await queued(servicer, 2)
            failure = await late  # the client's own timeout
            await asyncio.sleep(0.3)
        answer = await stream.read()  # the server's: dropped without running
        assert answer.call_id == 41 and answer.WhichOneof("outcome") == "error"
        assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0] and "deadline" in answer.error.message
        assert isinstance(failure, errors.Unavailable) and "DEADLINE_EXCEEDED" in str(failure)
        await servicer.worker.run(lambda: None)  # the worker is past the dropped calls
        assert servicer.scheduler.batch_sizes == before  # neither ran
        assert "late" not in servicer.engine.caches and "late-raw" not in servicer.engine.caches
        # the client's stream is still usable after its call timed out
        assert (await _verify(TargetClient(address, 30, MB16), "late", [], [1, 2])).cached_len == 2
        stream.cancel()
        await channel.close()
        await client.close()

    run(scenario())


@pytest.mark.service
def test_a_cancelled_caller_drops_its_call_and_the_stream_serves_on(draft, run):
    address, servicer, _ = draft

    async def scenario():
        client = DraftClient(address, 30, MB16)
        first = await client.propose("x", 0, 0, [3, 4, 5], 2, GREEDY, 1)
        stream = client.propose_stream._stream
        with held_worker(servicer):
            task = asyncio.ensure_future(client.propose("y", 0, 0, [3, 4, 5], 2, GREEDY, 1))
            await queued(servicer, 1)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        again = await client.propose("z", 0, 0, [3, 4, 5], 2, GREEDY, 1)
        assert again.draft_tokens == first.draft_tokens and client.propose_stream._stream is stream
        assert not stream.pending
        await client.close()

    run(scenario())


# ---- broken streams and older servers ---------------------------------------------------------

@pytest.mark.service
def test_a_stopped_server_fails_calls_like_a_dead_one_and_a_new_one_is_used(models, run):
    server, port, servicer, log = start_target(models)
    address = f"127.0.0.1:{port}"

    async def scenario():
        nonlocal server, servicer
        client = TargetClient(address, 30, MB16)
        await _verify(client, "s", [], [1, 2, 3])
        with held_worker(servicer):
            pending = asyncio.ensure_future(_failure(_verify(client, "s", [1, 2, 3], [4], wait_for_ready=False)))
            await queued(servicer, 1)
            stopping = server.stop(None)
            failure = await pending
        await asyncio.get_running_loop().run_in_executor(None, stopping.wait)
        assert isinstance(failure, errors.Unavailable), failure
        after = await _failure(_verify(client, "s", [1, 2, 3], [4], wait_for_ready=False))
        assert isinstance(after, errors.Unavailable), after
        server, _, servicer, _ = start_target(models, port=port)  # back on the same port
        deadline = time.monotonic() + 30
        while True:  # the channel reconnects within its backoff (at most 1 s)
            try:
                verdict = await _verify(client, "s", [], [1, 2, 3, 4], wait_for_ready=False)
                break
            except errors.Unavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        assert verdict.cached_len == 4 and client.verify_stream._stream is not None
        await client.close()

    try:
        run(scenario())
    finally:
        server.stop(None).wait()


def _unary_only_target(servicer, loop: asyncio.AbstractEventLoop) -> tuple[grpc.aio.Server, int]:
    """A TargetService with GetModelInfo and Verify only (an older server), on the real
    service's event loop and model worker."""
    def register(server: grpc.aio.Server) -> None:
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=request.FromString,
            response_serializer=lambda message: message.SerializeToString())
            for name, request in (("Verify", target_pb2.VerifyRequest),
                                  ("GetModelInfo", target_pb2.TargetServiceGetModelInfoRequest))}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specdec.v1.TargetService",
                                                                              handlers),))

    build = build_aio_server(register, ["specdec.v1.TargetService"], "127.0.0.1", _free_port(), MB16)
    return asyncio.run_coroutine_threadsafe(build, loop).result(30)


@pytest.mark.service
def test_falls_back_to_unary_calls_against_a_server_without_the_stream(models, run):
    real, _, servicer, _ = start_target(models)
    old, port = _unary_only_target(servicer, real.loop)

    async def scenario():
        client = TargetClient(f"127.0.0.1:{port}", 30, MB16)
        first = await _verify(client, "o", [], [1, 2, 3])
        assert client.verify_stream.unsupported and first.cached_len == 3
        second = await _verify(client, "o", [1, 2, 3], [4], drafts=[5])
        assert second.cached_len >= 4
        bad = await _failure(_verify(client, "o", [1, 2, 9], [4]))  # errors as before
        assert isinstance(bad, errors.CacheMiss) and bad.held == second.cached_len
        await client.close()

    try:
        run(scenario())
    finally:
        asyncio.run_coroutine_threadsafe(old.stop(None), real.loop).result(30)
        real.stop(None).wait()
