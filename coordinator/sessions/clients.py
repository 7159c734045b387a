"""Async clients of the draft and target services, speaking domain types.

Propose and Verify go over one long-lived call stream per client (transport "stream", see
specdec/rpc/streaming.py) or as unary calls ("unary"); both raise the same domain errors. A
server without the stream methods (an older one) is called unary from the first refusal on.
A call's deadline follows its input tokens and the replica's measured pace; on a stream, a call
that hears neither its answer nor progress for the client's ordinary timeout is given up sooner
(coordinator/sessions/deadlines.py). A timed-out call says what it was doing and for how long.
"""

from __future__ import annotations

import time

import grpc

from specdec.errors import CacheMiss, DeadlineExceeded, FailedPrecondition, SpecdecError
from specdec.rpc.convert import dist_from_pb, dist_to_pb, logprobs_from_pb, model_info_from_pb, sampling_to_pb
from specdec.rpc.security import name_override_options
from specdec.rpc.grpc_server import channel_options
from specdec.rpc.status import from_rpc_error
from specdec.rpc.streaming import CallStatus, CallStream, StreamUnsupported, overran
from specdec.types import ModelDescription, Proposal, RpcTransport, SamplingParams, SparseDist, Verdict
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

from coordinator.sessions.deadlines import Pace, call_deadline_s, describe_work


TRANSPORTS = tuple(RpcTransport)


class ServiceClient:
    """A channel to one service replica (TLS when `credentials` are given; `server_name`
    overrides the name checked in its certificate); failed calls become domain errors.
    `transport` "stream" sends the hot calls over a call stream, "unary" as unary calls."""

    kind = "service"

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
                 transport: str = RpcTransport.STREAM):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self.address = address
        self.transport = transport
        self._streams: list[CallStream] = []  # closed with the client
        self.timeout_s = timeout_s  # --rpc-timeout-s: the deadline of a call of ordinary size
        self.pace = Pace()  # this replica's measured seconds per input token
        self.tls = credentials is not None
        self.server_name = server_name
        options = channel_options(max_message_bytes)
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials,
                                                   options=options + name_override_options(server_name))

    @property
    def name(self) -> str:
        return f"{self.kind} service at {self.address}"

    def _call_stream(self, open_stream, request_type: type) -> CallStream | None:
        """The call stream of one method (None with the unary transport)."""
        if self.transport != RpcTransport.STREAM:
            return None
        stream = CallStream(open_stream, request_type, self.channel, self.name)
        self._streams.append(stream)
        return stream

    async def call(self, method, request, session_id: str = "", timeout_s: float | None = None,
                   wait_for_ready: bool = True, stream: CallStream | None = None, tokens: int = 0,
                   work: str = ""):
        """method(request) as a unary call, or on `stream` when one is given and the server has it.
        Its deadline: timeout_s (a fixed budget), else the one its `tokens` input tokens need at
        this replica's pace, which on a stream counts again from each progress message, the call
        being given up after the ordinary timeout without an answer or progress. `work` says what
        it does, for the error when it runs out of time."""
        timeout = timeout_s or call_deadline_s(tokens, self.pace.seconds_per_token, self.timeout_s)
        started = time.monotonic()
        try:
            answer = await self._call(method, request, timeout, None if timeout_s else self.timeout_s,
                                      wait_for_ready, stream)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, self.name, work)
            if isinstance(error, DeadlineExceeded) and tokens:
                self.pace.overran(time.monotonic() - started)  # a retry gets the time that needs
            if isinstance(error, CacheMiss):
                raise CacheMiss(session_id, error.held, getattr(request, "prefix_len", -1)) from exc
            raise error from exc
        self.pace.record(tokens, time.monotonic() - started)
        return answer

    async def _call(self, method, request, timeout: float, idle_s: float | None, wait_for_ready: bool,
                    stream: CallStream | None):
        started = time.monotonic()
        if stream is not None and not stream.unsupported:
            try:
                return await stream.call(request, timeout, wait_for_ready, idle_s)
            except StreamUnsupported:
                pass  # an older server: this call and the next ones go unary
        try:
            return await method(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise CallStatus(exc.code(), overran(time.monotonic() - started, timeout)) from exc

    async def close(self) -> None:
        for stream in self._streams:
            await stream.close()
        await self.channel.close()


class DraftClient(ServiceClient):
    kind = "draft"

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
                 transport: str = RpcTransport.STREAM):
        super().__init__(address, timeout_s, max_message_bytes, credentials, server_name, transport)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.answered = False  # a Propose came back: the replica's first (cold) call is behind it
        self.propose_stream = self._call_stream(lambda: self.stub.ProposeStream(wait_for_ready=False),
                                                draft_pb2.ProposeStreamRequest)

    async def info(self, timeout_s: float, fingerprint_vocab_size: int | None = None,
                   wait_for_ready: bool = True) -> ModelDescription:
        """The model description; its tokenizer fingerprint over ids < fingerprint_vocab_size if set."""
        request = draft_pb2.DraftServiceGetModelInfoRequest(fingerprint_vocab_size=fingerprint_vocab_size)
        response = await self.call(self.stub.GetModelInfo, request, timeout_s=timeout_s,
                                   wait_for_ready=wait_for_ready)
        return model_info_from_pb(response.info)

    async def propose(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int],
                      gamma: int, params: SamplingParams, seed: int, timeout_s: float | None = None,
                      hints: list[int] | None = None, min_confidence: float = 0.0,
                      uncommitted: int = 0, cache_salt: str = "", tree_nodes: int = 0) -> Proposal:
        """Fails fast (no waiting for a connection): a missing draft makes the round target-only.
        uncommitted: the history's last tokens that are drafts (a call made ahead)."""
        request = draft_pb2.ProposeRequest(
            session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash, new_tokens=new_tokens,
            num_speculative_tokens=gamma, sampling=sampling_to_pb(params), seed=seed, hint_tokens=hints,
            min_confidence=min_confidence, uncommitted_tokens=uncommitted, cache_salt=cache_salt,
            tree_nodes=tree_nodes,
        )
        response = await self.call(self.stub.Propose, request, session_id, timeout_s, wait_for_ready=False,
                                   stream=self.propose_stream, tokens=len(new_tokens),
                                   work=describe_work("Propose", len(new_tokens)))
        self.answered = True
        return Proposal(list(response.draft_tokens), [dist_from_pb(d) for d in response.draft_probs],
                        response.cached_len, response.num_hint_tokens_kept, response.restored_tokens,
                        tuple(response.draft_parents))

    async def release(self, session_id: str, timeout_s: float | None = None) -> bool:
        request = draft_pb2.DraftServiceReleaseRequest(session_id=session_id)
        return (await self.call(self.stub.Release, request, session_id, timeout_s)).released


class TargetClient(ServiceClient):
    kind = "target"

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
                 transport: str = RpcTransport.STREAM):
        super().__init__(address, timeout_s, max_message_bytes, credentials, server_name, transport)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.verify_stream = self._call_stream(lambda: self.stub.VerifyStream(wait_for_ready=False),
                                               target_pb2.VerifyStreamRequest)

    async def info(self, timeout_s: float, fingerprint_vocab_size: int | None = None,
                   wait_for_ready: bool = True) -> ModelDescription:
        """The model description; its tokenizer fingerprint over ids < fingerprint_vocab_size if set."""
        request = target_pb2.TargetServiceGetModelInfoRequest(fingerprint_vocab_size=fingerprint_vocab_size)
        response = await self.call(self.stub.GetModelInfo, request, timeout_s=timeout_s,
                                   wait_for_ready=wait_for_ready)
        return model_info_from_pb(response.info)

    async def verify(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int],
                     drafts: list[int], draft_probs: list[SparseDist], params: SamplingParams,
                     seed: int, wait_for_ready: bool = True, cache_salt: str = "",
                     top_logprobs: int | None = None, draft_parents: list[int] | None = None,
                     head_candidates: int = 0) -> Verdict:
        """head_candidates: ask a target with heads for each head's that many likeliest tokens
        (Verdict.head_proposals; a target without heads returns none)."""
        request = target_pb2.VerifyRequest(
            session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash, new_tokens=new_tokens,
            draft_tokens=drafts,
            draft_probs=[] if params.greedy else [dist_to_pb(d) for d in draft_probs],
            sampling=sampling_to_pb(params), seed=seed, cache_salt=cache_salt, top_logprobs=top_logprobs,
            draft_parents=draft_parents or [], head_candidates=head_candidates,
        )
        response = await self.call(self.stub.Verify, request, session_id, None, wait_for_ready,
                                   self.verify_stream, tokens=len(new_tokens) + len(drafts),
                                   work=describe_work("Verify", len(new_tokens), len(drafts)))
        logprobs = tuple(logprobs_from_pb(entry) for entry in response.logprobs)
        if top_logprobs is not None and len(logprobs) != response.num_accepted + 1:
            raise FailedPrecondition(
                f"the target service at {self.address} returned no log-probabilities (it predates "
                "top_logprobs): upgrade it, or leave top_logprobs unset")
        return Verdict(response.num_accepted, response.next_token, response.is_bonus,
                       list(response.accept_probs), response.cached_len, response.restored_tokens, logprobs,
                       tuple(response.accepted_nodes), tuple(dist_from_pb(d) for d in response.head_proposals))

    async def release(self, session_id: str, timeout_s: float | None = None) -> bool:
        request = target_pb2.TargetServiceReleaseRequest(session_id=session_id)
        return (await self.call(self.stub.Release, request, session_id, timeout_s)).released


async def release_quietly(client: ServiceClient, session_id: str) -> None:
    """Best effort: a service that is down holds nothing worth releasing."""
    try:
        await client.release(session_id, timeout_s=2.0)
    except SpecdecError:
        pass
