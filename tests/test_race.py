"""Two coordinators racing on one session never produce a history that differs from target-only greedy.

Leases far shorter than a round lapse all the time, so both coordinators drive the same
session on the same draft and target services at once. The store's lease and versioned
appends keep the committed history a single line; the prefix fingerprints keep each service
from verifying on KV that holds another coordinator's tokens. Every generated token of the
final history must be the target's greedy choice after the tokens before it.
"""

from __future__ import annotations

import threading

import grpc
import torch

from specdec.runtime.loader import load_model
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.procs import Coordinator

PROMPT = [3, 7, 5, 2, 8]
INPUTS = ([10, 4], [6, 11])  # what each coordinator's requests append
REQUESTS_PER_WORKER = 12


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
        coordinators = [Coordinator(*addresses, session_store=redis_url, session_lease_s=0.02) for _ in INPUTS]
        outcomes: dict[str, int] = {}
        lock = threading.Lock()

        def worker(coordinator: Coordinator, ids: list[int]) -> None:
            for _ in range(REQUESTS_PER_WORKER):
                try:
                    response = coordinator.complete(session_id=sid, token_ids=ids, max_new_tokens=6,
                                                    num_speculative_tokens=3, ignore_eos=True)
                    key = f"ok, cache_misses={min(response.stats.cache_misses, 1)}"
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
                    key = "taken over or busy"
                with lock:
                    outcomes[key] = outcomes.get(key, 0) + 1

        threads = [threading.Thread(target=worker, args=(c, ids))
                   for c, ids in zip(coordinators, INPUTS) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        for coordinator in coordinators:
            coordinator.stop()
        history = list(cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=sid)).token_ids)
    print(outcomes, len(history))
    assert sum(v for k, v in outcomes.items() if k.startswith("ok")) > 0
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


def test_the_check_can_fail():
    history = PROMPT + [10, 4, 9, 9, 6, 11, 9]
    pred = [0] * 4 + [10, 4, 9, 9, 9, 6, 11, 9]  # pred[i] = the token after history[:i + 1]
    assert explained(history, pred)
    assert not explained(history[:-1] + [8], pred)  # a generated token the target would not choose
