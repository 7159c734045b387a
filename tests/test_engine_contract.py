"""The engine contract (specdec/runtime/engine.py): every engine — torch, graph, llama.cpp —
is a ModelEngine, warms up before serving and leaves nothing behind, and hands out its own
per-round work: the graph engine's verification decides a batch's chains on the device, with
the host verifier's greedy verdicts and the target's distribution when sampled."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.config import TargetConfig
from specdec.maths.sampling import target_probs
from specdec.runtime.graph.device_verification import DeviceVerification
from specdec.runtime.engine import ModelEngine
from specdec.runtime.session_engine import SessionEngine
from specdec.runtime.engines import engine_from_config
from specdec.runtime.verification import HostVerification, VerifyCall
from specdec.types import SamplingParams, SparseDist
from tests.test_sampling import chi2_pvalue

pytestmark = pytest.mark.service

PROMPT = [5, 9, 14, 3, 22, 7]


def engine(model: str, backend: str, dtype: str = "float64") -> SessionEngine:
    return engine_from_config(TargetConfig(model=model, backend=backend, dtype=dtype, kv_cache_bytes=8 << 20))


@pytest.fixture(scope="module", params=["torch", "graph", "llama.cpp"])
def each_engine(request, models, tmp_path_factory) -> tuple[str, SessionEngine]:
    if request.param == "llama.cpp":
        from tests.gguf_writer import write_llama_gguf

        path = write_llama_gguf(models["llama"]["target"], tmp_path_factory.mktemp("contract") / "target.gguf")
        return request.param, engine(str(path), "llama.cpp")
    return request.param, engine(models["llama"]["target"], request.param)


def test_every_engine_keeps_the_contract_and_warms_up_cleanly(each_engine):
    backend, each_engine = each_engine
    assert isinstance(each_engine, ModelEngine)
    run_before = each_engine.tokens_run
    each_engine.warm_up()
    assert each_engine.tokens_run > run_before  # it ran the model
    assert len(each_engine.caches) == 0  # and kept no session
    entry, feed = each_engine.begin("after", 0, 0, PROMPT)  # a call after it starts from nothing
    assert len(entry) == 0 and list(feed) == PROMPT
    each_engine.release("after")
    # the graph engine decides a batch's chains on the device; the others row by row on the host
    assert (type(each_engine.verification()) is DeviceVerification) == (backend == "graph")
    assert isinstance(each_engine.verification(), HostVerification)


def _calls(verifier: HostVerification, params: SamplingParams, drafts_per_row: list[list[int]], seeds: list[int],
           q: list[list[SparseDist]] | None = None) -> list[VerifyCall]:
    return [verifier.call(f"s{i}", 0, 0, PROMPT + [i % 7], drafts, [] if q is None else q[i], params, seed)
            for i, (drafts, seed) in enumerate(zip(drafts_per_row, seeds))]


def test_device_verification_gives_the_host_verifiers_greedy_verdicts(models):
    graph = engine(models["llama"]["target"], "graph")
    device, host = graph.verification(), HostVerification(graph)
    assert isinstance(device, DeviceVerification)
    rows = [[1, 2, 3], [40], [7, 7], [9, 8, 7, 6, 5]]
    for verifier in (device, host):  # the same sessions from nothing, each time
        verdicts = verifier.verify_batch(_calls(verifier, SamplingParams(temperature=0.0), rows, [0] * 4))
        for i in range(len(rows)):
            graph.release(f"s{i}")
        if verifier is device:
            on_device = verdicts
    assert [(v.num_accepted, v.next_token, v.is_bonus, v.accept_probs, v.cached_len) for v in on_device] == \
        [(v.num_accepted, v.next_token, v.is_bonus, v.accept_probs, v.cached_len) for v in verdicts]


def test_device_verification_samples_the_targets_distribution(models):
    """One draft per row, drawn from a made-up q; over many rows in few batches the first
    emitted token follows the target's p (chi-square)."""
    graph = engine(models["llama"]["target"], "graph")
    verifier = graph.verification()
    params = SamplingParams(temperature=0.9)
    entry, feed = graph.begin("ref", 0, 0, PROMPT)
    p = target_probs(graph.forward("ref", entry, feed, 1), params)[0].double().numpy()  # [vocab]
    graph.release("ref")
    q = SparseDist((3, 4, 5), (0.5, 0.3, 0.2))
    rng = np.random.default_rng(0)
    counts, rounds, batch = np.zeros(len(p)), 40, 24
    for r in range(rounds):
        drafts = [[int(rng.choice(q.token_ids, p=q.probs))] for _ in range(batch)]
        calls = [verifier.call(f"r{i}", 0, 0, PROMPT, drafts[i], [q], params, r * batch + i) for i in range(batch)]
        for call, verdict in zip(calls, verifier.verify_batch(calls)):
            counts[call.drafts[0] if verdict.num_accepted else verdict.next_token] += 1
            graph.release(call.session_id)
    support = p > 1e-9
    assert counts[~support].sum() == 0
    assert chi2_pvalue(counts[support], p[support]) > 1e-3


def test_a_seeded_row_decides_alike_whatever_shares_its_batch(models):
    graph = engine(models["llama"]["target"], "graph")
    verifier = graph.verification()
    params, q = SamplingParams(temperature=1.0), [SparseDist((3, 4), (0.5, 0.5))] * 2

    def run(rows: int):
        calls = [verifier.call(f"x{i}", 0, 0, PROMPT, [3, 4], q, params, 11 + i) for i in range(rows)]
        verdicts = verifier.verify_batch(calls)
        for call in calls:
            graph.release(call.session_id)
        return verdicts[0].num_accepted, verdicts[0].next_token

    assert {run(1) for _ in range(3)} == {run(6)}
