"""Pipelined rounds keep commit-before-stream: a round's chunk reaches the client only once the
session store holds its tokens, however slow the store is, while the next round already runs.

The coordinator reaches a real redis-server through a TCP relay that holds every command for
a while (a slow or distant store), and the test reads the store directly (not through the relay)
the moment each chunk arrives. A request that ends leaves no call behind on the services.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import grpc
import pytest
import redis

from coordinator.sessions.redis_store import session_keys
from specdec.v1 import common_pb2
from tests.cluster import Cluster, generate_request
from tests.spies import RequestRecorder

PROMPT = [3, 7, 5, 2, 8, 9, 4]
HOLD_S = 0.03  # how long the relay holds each command on its way to Redis


class SlowRelay:
    """Forwards loopback TCP connections to a Redis, holding each piece the client sends for
    `hold_s` before passing it on; replies come back at once."""

    def __init__(self, host: str, port: int, hold_s: float):
        self.target = (host, port)
        self.hold_s = hold_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, self.hold_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, hold_s: float) -> None:
        try:
            while data := source.recv(65536):
                if hold_s:
                    time.sleep(hold_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def _through(url: str, port: int) -> str:
    """`url` with its host and port replaced by the relay's."""
    parts = urlsplit(url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{port}"))


@pytest.fixture
def slow_store(redis_url):
    parts = urlsplit(redis_url)
    relay = SlowRelay(parts.hostname or "127.0.0.1", parts.port or 6379, HOLD_S)
    yield _through(redis_url, relay.port), redis.Redis.from_url(redis_url)
    relay.close()


def _tokens_key(session_id: str) -> str:
    return session_keys(session_id)[1]


@pytest.mark.parametrize("gamma", [2, 0])
def test_a_chunk_is_streamed_only_after_its_tokens_are_stored(models, slow_store, gamma):
    url, direct = slow_store
    recorder = RequestRecorder("Propose", "Verify")
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"], coordinator={"session_store": url},
                 interceptors=[recorder]) as cluster:
        streamed: list[int] = []
        chunks = 0
        stored_when_streamed = []
        for chunk in cluster.stub.Generate(generate_request(
                token_ids=PROMPT, max_new_tokens=16, num_speculative_tokens=gamma, ignore_eos=True), timeout=120):
            stored = direct.llen(_tokens_key(chunk.session_id))  # at once, not through the relay
            streamed += chunk.token_ids
            chunks += 1
            stored_when_streamed.append((stored, len(PROMPT) + len(streamed)))
            final = chunk
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(streamed) == 16
        assert all(stored >= needed for stored, needed in stored_when_streamed), stored_when_streamed
        history = [int(t) for t in direct.lrange(_tokens_key(final.session_id), 0, -1)]
        assert history == PROMPT + streamed
        # the round after the last one was never started: one Verify (and Propose) per chunk
        time.sleep(0.2)
        calls = [name for name, _ in recorder.take()]
        assert final.stats.rounds == chunks
        assert calls.count("Verify") == chunks
        assert calls.count("Propose") == final.stats.draft_rounds and (final.stats.draft_rounds > 0) == (gamma > 0)


def test_lease_lost_mid_stream_ends_it_with_nothing_unstored_and_no_call_left(models, redis_url):
    recorder = RequestRecorder("Propose", "Verify")
    direct = redis.Redis.from_url(redis_url)
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"], coordinator={"session_store": redis_url},
                 interceptors=[recorder]) as cluster:
        stream = cluster.stub.Generate(generate_request(
            token_ids=PROMPT, max_new_tokens=400, num_speculative_tokens=2, ignore_eos=True), timeout=120)
        streamed: list[int] = []
        with pytest.raises(grpc.RpcError) as info:
            for i, chunk in enumerate(stream):
                streamed += chunk.token_ids
                if i == 1:  # another request takes the session over
                    direct.set(session_keys(chunk.session_id)[2], "another-request")
                    sid = chunk.session_id
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "taken over" in info.value.details()
        calls = len(recorder.take())
        history = [int(t) for t in direct.lrange(_tokens_key(sid), 0, -1)]
        assert history[:len(PROMPT) + len(streamed)] == PROMPT + streamed  # every streamed token is stored
        assert len(history) <= len(PROMPT) + len(streamed) + 3  # at most the round it was writing
        time.sleep(0.3)
        assert len(recorder.take()) == 0 and calls > 0  # nothing was still running or started after it
        assert cluster.coordinator.round_loop.active == 0
