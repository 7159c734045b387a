"""The chaos soak's clients (bench/chaos.py): what each worker asks for (new or continued
sessions, greedy or seeded sampling, a fixed or adaptive γ, proposers auto, draft and ngram, all
in token ids), which failures it retries and how (after the server's retry-after-ms hint, then
reading the session back and continuing it for the tokens still owed), how long a request may
take, and what the tally keeps for the checks: the tokens every session must hold, the greedy
requests as committed, the time per token, the errors by status."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED}
MAX_SESSION_TOKENS = 400  # the tiny models' context is 512
ATTEMPT_TIMEOUT_S = 30.0  # one attempt's deadline (the client's)
REQUEST_BUDGET_S = 120.0  # a request, retries included, must end within this


@dataclass
class GreedyCase:
    """A greedy request as committed: the history it started from and the tokens it generated."""

    history: list[int]
    generated: list[int]


@dataclass
class Tally:
    requests: int = 0
    retries: int = 0
    failed_requests: int = 0                 # gave up (out of retries or budget)
    overdue_requests: int = 0                # ended past REQUEST_BUDGET_S
    tokens: int = 0
    lost_seen: int = 0                       # tokens a client was streamed that a session lacked at a retry
    errors: Counter = field(default_factory=Counter)
    messages: dict[str, str] = field(default_factory=dict)  # a sample message per status
    sessions: dict[str, list[int]] = field(default_factory=dict)  # session -> tokens it must hold
    greedy: list[GreedyCase] = field(default_factory=list)
    token_gaps: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds per token)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, exc: grpc.RpcError) -> None:
        with self.lock:
            name = exc.code().name
            self.errors[name] += 1
            self.messages.setdefault(name, (exc.details() or "")[:300])


class Client:
    """One worker: requests on its sessions until the deadline (module docstring)."""

    def __init__(self, index: int, addresses: list[str], vocab: int, tally: Tally, deadline: float, seed: int):
        self.rng = random.Random(seed * 7919 + index)
        self.channels = [grpc.insecure_channel(a) for a in addresses]
        self.stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self.channels]
        self.vocab, self.tally, self.deadline = vocab, tally, deadline
        self.session_id, self.history = "", []  # the session and every token it holds (as far as we know)

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                self.request()
        finally:
            for channel in self.channels:
                channel.close()

    def request(self) -> None:
        rng = self.rng
        inputs = [rng.randrange(1, self.vocab) for _ in range(rng.randint(2, 12))]
        max_new = rng.randint(4, 24)
        if (not self.session_id or rng.random() < 0.3
                or len(self.history) + len(inputs) + max_new > MAX_SESSION_TOKENS):
            self.session_id, self.history = "", []
        greedy = rng.random() < 0.5
        sampling = common_pb2.SamplingParams(temperature=0.0 if greedy else 0.8, seed=rng.randrange(1 << 30))
        fields = {"sampling": sampling, "ignore_eos": True,
                  "proposer": rng.choice([coordinator_pb2.PROPOSER_AUTO, coordinator_pb2.PROPOSER_DRAFT,
                                          coordinator_pb2.PROPOSER_NGRAM])}
        if rng.random() < 0.5:
            fields["num_speculative_tokens"] = rng.randint(1, 5)
        started = time.monotonic()
        start_len = len(self.history)
        owed, send_inputs, attempts = max_new, inputs, 0
        with self.tally.lock:
            self.tally.requests += 1
        while True:
            stub = rng.choice(self.stubs)
            request = coordinator_pb2.GenerateRequest(
                session_id=self.session_id, token_ids=coordinator_pb2.TokenIds(ids=send_inputs),
                max_new_tokens=owed, **fields)
            seen: list[int] = []
            last = time.monotonic()
            try:
                for chunk in stub.Generate(request, timeout=ATTEMPT_TIMEOUT_S):
                    if not self.session_id:
                        self.session_id = chunk.session_id
                    now = time.monotonic()
                    if chunk.token_ids:
                        with self.tally.lock:
                            self.tally.token_gaps.append((now, (now - last) / len(chunk.token_ids)))
                    last = now
                    seen.extend(chunk.token_ids)
                self.history += list(send_inputs) + seen
                break
            except grpc.RpcError as exc:
                self.tally.error(exc)
                attempts += 1
                if (exc.code() not in RETRYABLE or attempts > 8
                        or time.monotonic() - started > REQUEST_BUDGET_S - ATTEMPT_TIMEOUT_S):
                    with self.tally.lock:
                        self.tally.failed_requests += 1
                    self.session_id, self.history = "", []
                    return
                with self.tally.lock:
                    self.tally.retries += 1
                time.sleep(max(min(0.25 * attempts, 2.0), retry_after_s(exc)))
                if not self.session_id:  # nothing streamed of a new session: start it again
                    continue
                stored = self.read_session()
                if stored is None:
                    with self.tally.lock:
                        self.tally.failed_requests += 1
                    self.session_id, self.history = "", []
                    return
                must = self.history + (list(send_inputs) + seen if seen else [])
                lost = sum(1 for i, t in enumerate(must) if i >= len(stored) or stored[i] != t)
                with self.tally.lock:
                    self.tally.lost_seen += lost
                prompt_in = stored[:len(self.history) + len(send_inputs)] == self.history + list(send_inputs)
                if prompt_in and len(stored) > len(self.history):
                    generated = len(stored) - start_len - len(inputs)
                    self.history = stored
                    owed, send_inputs = max_new - generated, []
                    if owed <= 0:
                        break
                else:
                    self.history = stored
        elapsed = time.monotonic() - started
        with self.tally.lock:
            self.tally.tokens += len(self.history) - start_len - len(inputs)
            self.tally.overdue_requests += elapsed > REQUEST_BUDGET_S
            self.tally.sessions[self.session_id] = list(self.history)
            if greedy:
                split = start_len + len(inputs)
                self.tally.greedy.append(GreedyCase(self.history[:split], self.history[split:]))

    def read_session(self) -> list[int] | None:
        """The session's committed tokens, from any coordinator that answers within 60 s."""
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            stub = self.rng.choice(self.stubs)
            try:
                reply = stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=self.session_id), timeout=5)
                return list(reply.token_ids)
            except grpc.RpcError as exc:
                self.tally.error(exc)
                if exc.code() not in RETRYABLE:
                    return None
                time.sleep(0.5)
        return None


def retry_after_s(exc: grpc.RpcError) -> float:
    """The server's retry-after-ms hint (a busy session, a full queue), at most 30 s; 0 without one."""
    try:
        hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms")
        return min(int(hint) / 1000, 30.0) if hint is not None else 0.0
    except (ValueError, TypeError):
        return 0.0
