"""A stopped target is still caught within the ordinary deadline, however long the call.

A long call's deadline follows its work (coordinator/sessions/deadlines.py): a 3,900-token
prefill may run for several times --rpc-timeout-s. What catches a target that stopped answering
(SIGSTOP here) is the liveness limit a long call does not block: a streamed call that hears
neither its answer nor progress for --rpc-timeout-s is given up, the replica fails its health
check and is marked failed, and the request moves to the other replica — well before the long
call's own deadline — with the output of target-only decoding.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future

import torch

from coordinator.sessions.deadlines import call_deadline_s
from coordinator.sessions.routing import PROBE_TIMEOUT_S
from draft_service import server as draft_server
from specdec.config import DraftConfig
from specdec.runtime.loader import load_model
from tests.procs import Coordinator, ServiceProcess, start_together
from tests.redis_server import free_port

ORDINARY_S = 1.0  # --rpc-timeout-s
LONG = 3900  # tokens of the long turn
NEW = 8


def greedy(target_dir: str, history: list[int], new_tokens: int) -> list[int]:
    """What the target alone produces after a history: transformers' greedy generate, float64."""
    model = load_model(target_dir, "float64").model
    model.generation_config.eos_token_id = None
    ids = torch.tensor([history])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(history):].tolist()


def test_a_stopped_target_is_caught_within_the_ordinary_deadline(long_context_pair):
    draft_dir, target_dir = long_context_pair
    targets = start_together(ServiceProcess("target", target_dir), ServiceProcess("target", target_dir))
    draft, port, _ = draft_server.start(DraftConfig(model=draft_dir, dtype="float64", port=free_port()))
    coordinator = Coordinator(f"127.0.0.1:{port}", ",".join(t.address for t in targets),
                              rpc_timeout_s=ORDINARY_S, target_retry_s=30)
    turn = dict(max_new_tokens=NEW, num_speculative_tokens=3, ignore_eos=True)
    try:
        first = coordinator.complete(token_ids=[5, 6, 7, 8], **turn)
        sid = first.session_id
        held_by = coordinator.record(sid).target.address
        stopped, other = sorted(targets, key=lambda t: t.address != held_by)
        stopped.pause()  # SIGSTOP: it answers nothing, not even its health check
        long_turn = [random.Random(1).randrange(1, 380) for _ in range(LONG)]
        started = time.monotonic()
        failed_after = _when_failed(coordinator, stopped.address, started)
        response = coordinator.complete(session_id=sid, token_ids=long_turn, **turn)
        states = coordinator.replicas("target")
        record = coordinator.record(sid)
    finally:
        for target in targets:
            target.resume()
        coordinator.stop()
        draft.stop(None).wait()
        for target in targets:
            target.stop()
    detected = failed_after.result(timeout=1)
    # given up after the ordinary deadline without progress, then its health check timed out
    assert detected < ORDINARY_S + PROBE_TIMEOUT_S + 1.0, f"marked failed after {detected:.1f} s"
    assert detected < call_deadline_s(LONG, None, ORDINARY_S)  # not by the long call's own deadline
    assert response.stats.target_retries >= 1
    assert states[stopped.address] == "failed" and states[other.address] == "ready", states
    assert record.target.address == other.address
    history = list(record.token_ids)
    assert list(response.token_ids) == history[-NEW:] == greedy(target_dir, history[:-NEW], NEW)


def _when_failed(coordinator: Coordinator, address: str, since: float):
    """A future: seconds from `since` until the coordinator marks the replica failed (polled)."""
    result: Future = Future()

    def poll() -> None:
        while time.monotonic() - since < 60:
            if coordinator.replicas("target").get(address) == "failed":
                result.set_result(time.monotonic() - since)
                return
            time.sleep(0.05)
        result.set_exception(AssertionError("the stopped target was never marked failed"))

    threading.Thread(target=poll, daemon=True).start()
    return result
