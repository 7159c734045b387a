"""Two coordinators racing on one session never produce a history that differs from target-only greedy.

A thief deletes the session's lease in Redis every few milliseconds (a lease that lapsed
during a long round, a partition), so both coordinators drive the same session on the same
draft and target services at once. The store's lease and versioned
appends keep the committed history a single line; the prefix fingerprints keep each service
from verifying on KV that holds another coordinator's tokens. Every generated token of the
final history must be the target's greedy choice after the tokens before it.

Here the e2e tests; the other tiers' are in tests/unit/test_race.py.
"""

from __future__ import annotations

import threading

import grpc
import redis
import torch

from coordinator.sessions.redis_store import session_keys
from specdec.runtime.loader import load_model
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.procs import Coordinator

PROMPT = [3, 7, 5, 2, 8]
INPUTS = ([10, 4], [6, 11])  # what each coordinator's requests append
RACE_S = 8.0


def greedy_predictions(target_dir: str, history: list[int]) -> list[int]:
    """pred[i] = the target's greedy token after history[:i + 1]."""
    model = load_model(target_dir, "float64").model
    with torch.inference_mode():
        return model(torch.tensor([history])).logits[0].argmax(-1).tolist()


def test_two_coordinators_racing_on_one_session(small_vocab_models, redis_url):
    draft, target = small_vocab_models["draft"], small_vocab_models["target"]
    with Cluster(draft, target, coordinator={"session_store": redis_url}) as cluster:
        sid = cluster.complete(token_ids=PROMPT, max_new_tokens=3, ignore_eos=True).session_id
        addresses = (f"127.0.0.1:{cluster.draft_port}", f"127.0.0.1:{cluster.target_port}")
        coordinators = [Coordinator(*addresses, session_store=redis_url) for _ in INPUTS]
        outcomes: dict[str, int] = {}
        lock = threading.Lock()
        done = threading.Event()

        def thief() -> None:
            client = redis.Redis.from_url(redis_url)
            while not done.wait(0.1):
                client.delete(session_keys(sid)[2])

        def worker(coordinator: Coordinator, ids: list[int]) -> None:
            while not done.is_set():
                try:
                    response = coordinator.complete(session_id=sid, token_ids=ids, max_new_tokens=16,
                                                    num_speculative_tokens=3, ignore_eos=True)
                    key = f"ok, cache misses={response.stats.cache_misses > 0}"
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "start a new session" in exc.details():
                        done.set()  # the session filled the model's context
                        continue
                    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
                    key = "taken over or busy"
                    done.wait(0.01)
                with lock:
                    outcomes[key] = outcomes.get(key, 0) + 1

        threads = [threading.Thread(target=worker, args=(c, ids))
                   for c, ids in zip(coordinators, INPUTS) for _ in range(2)]
        threads.append(threading.Thread(target=thief))
        for thread in threads:
            thread.start()
        done.wait(RACE_S)
        done.set()
        for thread in threads:
            thread.join(120)
        for coordinator in coordinators:
            coordinator.stop()
        history = list(cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=sid)).token_ids)
    print(outcomes, len(history))
    assert len(history) > len(PROMPT) + 60, (outcomes, len(history))
    assert explained(history, greedy_predictions(target, history)), history


def explained(history: list[int], pred: list[int]) -> bool:
    """Whether the history after the prompt splits into the target's greedy tokens and whole inputs."""
    inputs = {tuple(ids) for ids in INPUTS}
    ok = [False] * (len(history) + 1)  # ok[i]: history[i:] splits that way
    ok[len(history)] = True
    for i in range(len(history) - 1, len(PROMPT) - 1, -1):
        generated = history[i] == pred[i - 1] and ok[i + 1]
        appended = tuple(history[i:i + 2]) in inputs and ok[min(i + 2, len(history))]
        ok[i] = generated or appended
    return ok[len(PROMPT)]
