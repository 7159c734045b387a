"""Many replicas per tier, real processes: 2 drafts and 2 targets (`specdec serve`), one
coordinator with static lists and Redis. Sessions spread over the replicas and stay on them; a
killed target moves only its sessions, with greedy output identical to target-only output; a
restarted one takes back the sessions that hash to it; a killed draft moves its sessions too; a
replica with another tokenizer is refused."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator.sessions.routing import rank
from draft_service import server as draft_server
from specdec_cli import tiny
from specdec.config import DraftConfig
from specdec.runtime.loader import load_model
from tests.procs import Coordinator, ServiceProcess
from tests.redis_server import free_port

SESSIONS = 20
NEW = 8
GAMMA = 3


class Greedy:
    """What the target alone produces after a history: transformers' greedy generate, float64."""

    def __init__(self, target_dir: str):
        self.loaded = load_model(target_dir, "float64")
        self.loaded.model.generation_config.eos_token_id = None

    def __call__(self, history: list[int], new_tokens: int) -> list[int]:
        ids = torch.tensor([history])
        # an explicit mask: histories may hold EOS (id 0, also the pad id), which must be attended to
        out = self.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(history):].tolist()


@pytest.fixture(scope="module")
def replicas(models):
    paths = models["llama"]
    procs = [ServiceProcess("draft", paths["draft"]), ServiceProcess("draft", paths["draft"]),
             ServiceProcess("target", paths["target"]), ServiceProcess("target", paths["target"])]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:  # start them side by side
            list(pool.map(lambda p: p.start(), procs))
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def foreign_draft(tmp_path):
    """A draft service whose model has another tokenizer (12 words), in this process."""
    model = tiny.build_model(tmp_path / "foreign", tiny.word_tokenizer(12), "llama", seed=3)
    server, port, _ = draft_server.start(DraftConfig(model=str(model), dtype="float64", port=free_port()))
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sessions_spread_fail_over_and_come_back(models, replicas, foreign_draft, redis_url):
    d1, d2, t1, t2 = replicas
    greedy = Greedy(models["llama"]["target"])
    coordinator = Coordinator(f"{d1.address},{d2.address},{foreign_draft}", f"{t1.address},{t2.address}",
                              session_store=redis_url, target_retry_s=30)

    states, record = coordinator.replicas, coordinator.record

    def turn(sid: str | None, **fields):
        response = coordinator.complete(session_id=sid or "", max_new_tokens=NEW, num_speculative_tokens=GAMMA,
                                        ignore_eos=True, **fields)
        tokens = record(response.session_id).token_ids
        r = record(response.session_id)
        assert list(response.token_ids) == tokens[-NEW:] == greedy(tokens[:-NEW], NEW), (
            response.stats, r.target.address, r.draft.address, len(tokens), fields)
        return response

    try:
        # the foreign draft is refused; the four good replicas are used
        _wait(lambda: states("draft") == {d1.address: "ready", d2.address: "ready", foreign_draft: "refused"},
              "draft replicas")
        _wait(lambda: states("target") == {t1.address: "ready", t2.address: "ready"}, "target replicas")
        refusal = coordinator.describe_replicas("draft")
        assert "different tokenizers" in refusal and "12 tokens" in refusal

        sids = [turn(None, prompt=f"session {i}: def f(x):").session_id for i in range(SESSIONS)]
        placed = {sid: record(sid) for sid in sids}
        drafts = Counter(r.draft.address for r in placed.values())
        targets = Counter(r.target.address for r in placed.values())
        assert set(drafts) == {d1.address, d2.address} and set(targets) == {t1.address, t2.address}
        for sid, r in placed.items():  # each session on its rendezvous choice
            assert r.draft.address == rank(sid, [d1.address, d2.address])[0]
            assert r.target.address == rank(sid, [t1.address, t2.address])[0]
        on_t1 = {sid for sid, r in placed.items() if r.target.address == t1.address}

        # kill t1 in the middle of a stream of one of its sessions: the stream completes on t2
        streamed = next(iter(sorted(on_t1)))
        tokens, last = [], None
        for i, chunk in enumerate(coordinator.stream(session_id=streamed, prompt=" go on", max_new_tokens=120,
                                                     num_speculative_tokens=GAMMA, ignore_eos=True)):
            tokens.extend(chunk.token_ids)
            last = chunk
            if i == 0:
                t1.pause()  # freeze it mid-round, so the kill lands mid-stream
                t1.kill()
        history = record(streamed).token_ids
        assert tokens == history[-120:] == greedy(history[:-120], 120)
        assert last.stats.target_retries >= 1
        # every other session continues on t2, output unchanged; only t1's sessions moved
        after_kill = {}
        for sid in sids:
            if sid != streamed:
                response = turn(sid, prompt=" more")
                assert response.stats.target_retries == 0  # t1 is known failed: t2 directly
            after_kill[sid] = record(sid)
        assert all(r.target.address == t2.address for r in after_kill.values())
        moved = {sid for sid in sids if after_kill[sid].target.address != placed[sid].target.address}
        assert moved == on_t1
        assert all(after_kill[sid].draft.address == placed[sid].draft.address for sid in sids)

        # t1 is back (same address): the sessions that hash to it go back to it
        t1.start()
        _wait(lambda: states("target").get(t1.address) == "ready", "t1 to answer health checks")
        for sid in sids:
            turn(sid, prompt=" again")
        back = {sid: record(sid) for sid in sids}
        assert all(r.target.address == placed[sid].target.address for sid, r in back.items())
        moved_back = {sid for sid in sids if back[sid].target.address != after_kill[sid].target.address}
        assert moved_back == on_t1

        # a draft replica killed: the round that finds it dead runs target-only, its sessions move to d2
        d1.kill()
        fallbacks = 0
        for sid in sids:
            response = turn(sid, prompt=" last")
            fallbacks += response.stats.fallback_rounds
            assert response.stats.draft_tokens > 0
        final = {sid: record(sid) for sid in sids}
        assert all(r.draft.address == d2.address for r in final.values())
        assert fallbacks == 1  # only the first round that met the dead replica
        draft_moved = sum(placed[sid].draft.address == d1.address for sid in sids)
        print(f"\nsessions per draft: {dict(drafts)}; per target: {dict(targets)}; "
              f"moved after the target kill: {len(moved)} (all of {t1.address}'s); moved back after its "
              f"restart: {len(moved_back)}; moved after the draft kill: {draft_moved}; "
              f"outputs identical to target-only: {len(sids) * 4} turns + 1 stream of 120 tokens")
    finally:
        coordinator.stop()
