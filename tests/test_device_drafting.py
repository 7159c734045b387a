"""The graph engine's device draft loop (specdec/runtime/graph/device_drafting.py,
graph/draft_loop.py): greedy drafts, their q and what the session keeps are the host loop's;
sampled drafts are draws from the q reported with them (chi-square, pooled over every call);
a seeded call drafts alike whatever shares its batch; calls the loop does not cover take the
host loop in the same batch; the loop reads the device once per batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.config import DraftConfig
from specdec.errors import ResourceExhausted
from specdec.fingerprint import fingerprint
from specdec.maths.sampling import proposal_top_k
from specdec.runtime.graph.batched_proposal import RowWarps, proposal_rows
from specdec.runtime.graph.device_drafting import DeviceDrafting
from specdec.runtime.drafting import HostDrafting
from specdec.runtime.engines import engine_from_config
from specdec.runtime.graph.engine import GraphEngine
from specdec.runtime.loader import load_model
from specdec.types import SamplingParams
from tests.test_sampling import chi2_pvalue

pytestmark = pytest.mark.service

PROMPT = [5, 9, 1, 3, 10, 7]  # within the 12-token vocabulary
K = 8  # a proposal top-K smaller than the vocabulary, so truncation shows


@pytest.fixture(scope="module")
def draft(small_vocab_models):
    """A 12-token draft on the graph engine, float64, its device loop made and warmed up."""
    engine = engine_from_config(DraftConfig(model=small_vocab_models["draft"], backend="graph", dtype="float64",
                                            kv_cache_bytes=8 << 20, proposal_top_k=K))
    device = engine.drafting(K)
    engine.warm_up()
    return engine, device


def _propose(drafting, engine, params, gammas, seeds=None, prompts=None, release=True, **kwargs):
    seeds = seeds or [100 + i for i in range(len(gammas))]
    prompts = prompts or [PROMPT + [i % 5] for i in range(len(gammas))]
    calls = [drafting.call(f"s{i}", 0, 0, prompt, gamma, params, seed, **kwargs)
             for i, (prompt, gamma, seed) in enumerate(zip(prompts, gammas, seeds))]
    proposals = drafting.propose_batch(calls)
    if release:
        for call in calls:
            engine.release(call.session_id)
    return proposals


def _summary(proposals):
    return [(p.draft_tokens, p.draft_probs, p.cached_len, p.hints_kept) for p in proposals]


def test_greedy_drafts_are_the_host_loops(draft):
    engine, device = draft
    host = HostDrafting(engine, K)
    greedy = SamplingParams(temperature=0.0)
    assert isinstance(device, DeviceDrafting)
    before = engine.draft_loop.eager_runs
    for gammas, kwargs in (([3, 1, 5], {}), ([6, 2], {"min_confidence": 0.4}), ([7], {})):
        # 3 rows and γ up to 5: a bucket of 4 rows and 8 steps, padding in both
        assert _summary(_propose(device, engine, greedy, gammas, **kwargs)) == \
            _summary(_propose(host, engine, greedy, gammas, **kwargs))
    assert engine.draft_loop.eager_runs == before + 3  # the device loop ran each batch
    assert len(engine.caches) == 0


def test_a_session_continues_after_the_loop_as_after_the_host_loop(draft):
    """The K/V the loop keeps (drafts run, none past the last) serves the next call's rollback."""
    engine, device = draft
    greedy = SamplingParams(temperature=0.0)
    outcomes = []
    for drafting in (device, HostDrafting(engine, K)):
        first = _propose(drafting, engine, greedy, [4], release=False)[0]
        held = len(PROMPT) + 3  # the prompt, its last token and two drafts the target accepted
        assert first.cached_len == held + 1  # drafts 1..3 run, the fourth not
        call = drafting.call("s0", held, fingerprint(PROMPT + [0] + first.draft_tokens[:2]), [3], 3, greedy, 1)
        second = drafting.propose_batch([call])[0]
        engine.release("s0")
        outcomes.append((first.draft_tokens, second.draft_tokens, second.cached_len))
    assert outcomes[0] == outcomes[1]


def test_calls_outside_the_loop_take_the_host_loop_in_the_same_batch(draft):
    engine, device = draft
    host = HostDrafting(engine, K)
    greedy = SamplingParams(temperature=0.0)
    for kwargs in ({"hints": [3, 4]},):
        assert _summary(_propose(device, engine, greedy, [2, 3], **kwargs)) == \
            _summary(_propose(host, engine, greedy, [2, 3], **kwargs))
    wide = SamplingParams(temperature=1.0, top_k=K + 2)  # wider than the proposal's K: the host loop
    runs = engine.draft_loop.eager_runs
    proposals = _propose(device, engine, wide, [3, 3])
    assert engine.draft_loop.eager_runs == runs
    assert all(len(p.draft_tokens) == 3 and all(len(q.token_ids) <= K for q in p.draft_probs) for p in proposals)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5, top_p=0.9)],
                         ids=["temperature", "top-k-top-p"])
def test_proposal_rows_equal_the_host_warp(params):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    mixed = [params, SamplingParams(temperature=0.0)] * 2 + [params]
    ids, probs = proposal_rows(logits, RowWarps.of(mixed), K)  # [5, K]
    for r, row_params in enumerate(mixed):
        if row_params.greedy:
            assert ids[r, 0] == logits[r].argmax() and probs[r].tolist() == [1.0] + [0.0] * (K - 1)
            continue
        want_ids, want_probs = proposal_top_k(logits[r:r + 1], row_params, K)
        assert torch.equal(ids[r], want_ids[0]) and torch.allclose(probs[r], want_probs[0], atol=1e-6)


def _reference_q(engine, history, params):
    """The draft's proposal after `history`, computed by a plain forward (not the loop)."""
    entry, feed = engine.begin("ref", 0, 0, history)
    logits = engine.forward("ref", entry, feed, 1)
    engine.release("ref")
    ids, probs = proposal_top_k(logits, params, K)
    dense = np.zeros(engine.vocab_size)
    dense[ids[0].numpy()] = probs[0].double().numpy()
    return dense


def test_sampled_drafts_are_draws_from_their_q(draft):
    """Pooled over every call: the first draft against q after the prompt, the second against
    each call's own q after its first draft (computed apart from the loop), chi-square."""
    engine, device = draft
    params = SamplingParams(temperature=1.0, top_k=6)
    first_q = _reference_q(engine, PROMPT, params)
    counts, expected = np.zeros((2, engine.vocab_size)), np.zeros((2, engine.vocab_size))
    second_q = {}
    batch = 20
    for b in range(30):
        proposals = _propose(device, engine, params, [2] * batch, seeds=[b * batch + i for i in range(batch)],
                             prompts=[PROMPT] * batch)
        for proposal in proposals:
            d1, d2 = proposal.draft_tokens
            if d1 not in second_q:
                second_q[d1] = _reference_q(engine, PROMPT + [d1], params)
            counts[0, d1] += 1
            counts[1, d2] += 1
            expected[0] += first_q
            expected[1] += second_q[d1]
    for step in range(2):
        support = expected[step] > 1e-9
        assert counts[step][~support].sum() == 0
        assert chi2_pvalue(counts[step][support], expected[step][support]) > 1e-3


def test_a_seeded_call_drafts_alike_whatever_shares_its_batch(draft):
    engine, device = draft
    params = SamplingParams(temperature=1.0)
    alone = _propose(device, engine, params, [4], seeds=[7])[0]
    together = _propose(device, engine, params, [4, 2, 3], seeds=[7, 8, 9])[0]
    assert _summary([alone]) == _summary([together])


def test_the_loop_reads_the_device_once_per_batch():
    from bench import launches

    model, _ = launches.build_model("tiny")
    rows = launches.Rows(launches.make_engine(model, "graph"), 32)
    for temperature in (0.0, 1.0):
        spec = launches.RowSpec(f"loop-{temperature}", "draft", 4, temperature, False)
        assert launches.measure_row(rows, spec, repeats=1, warmup=1).syncs == 1


def test_trees_of_a_batch_are_the_host_loops_each_depth_picked_on_the_device(draft):
    """Trees of several depths and budgets, greedy and sampled (a tree's children are picked by
    rank: deterministic either way), beside a chain in one batch: the device's trees are the
    host loop's, node for node, and so is what each session keeps (a sampled chain draws apart:
    the device's draws are inverse-CDF, the host's multinomial)."""
    engine, device = draft
    host = HostDrafting(engine, K)
    # greedy: a tree 6 deep, whose window (20 nodes) is past the buckets' 16: forwards in their own
    # shape; sampled: 5 trees, forwards padded to a bucket of 8 rows
    for params, shapes in ((SamplingParams(temperature=0.0), ((2, 4), (6, 8), (3, 3), (1, 2))),
                           (SamplingParams(temperature=1.3, top_k=3, top_p=0.8), ((2, 4), (4, 8), (3, 3), (1, 2), (2, 5)))):
        outcomes = []
        for drafting in (device, host):
            calls = [drafting.call(f"t{i}", 0, 0, PROMPT + [i], gamma, params, 5 + i, tree_nodes=nodes)
                     for i, (gamma, nodes) in enumerate(shapes + ((3, 0),))]
            loops = device.tree_loops
            proposals = drafting.propose_batch(calls)
            outcomes.append([(p.draft_tokens, p.parents, p.cached_len) for p in proposals])
            for call in calls:
                engine.release(call.session_id)
        compared = len(outcomes[0]) if params.greedy else len(shapes)
        assert outcomes[0][:compared] == outcomes[1][:compared], params
        assert device.tree_loops == loops  # the host loop's run did not reach the device's
        assert all(parents for _, parents, _ in outcomes[0][:-1]) and not outcomes[0][-1][1]
    assert device.tree_loops > 0


def test_a_tree_the_pool_cannot_hold_fails_alone_and_keeps_the_history(draft, small_vocab_models):
    """The loop's node slots are allocated up front: a pool too small for them refuses the
    tree calls (RESOURCE_EXHAUSTED), the session keeps its history, a shallower tree then grows."""
    engine, _ = draft
    block = engine.kv_spec.bytes_per_block
    engine = GraphEngine(load_model(small_vocab_models["draft"], "float64"), 8, 3 * block, 16,
                         block_size=16)  # 3 blocks: the null block and 32 tokens for sessions
    drafting = engine.drafting(K)
    prompt = (PROMPT * 5)[:26]
    deep = drafting.call("s", 0, 0, prompt, 3, SamplingParams(temperature=0.0), 1, tree_nodes=6)  # 26 + 8 > 32
    result = drafting.propose_batch([deep])[0]
    assert isinstance(result, ResourceExhausted)
    assert engine.kv.length(engine.caches.get("s").kv.pool_id) == len(prompt)  # the history only
    shallow = drafting.call("s", len(prompt), fingerprint(prompt), [3], 2, SamplingParams(temperature=0.0), 1,
                            tree_nodes=4)  # 27 + 4 ≤ 32
    proposal = drafting.propose_batch([shallow])[0]
    assert len(proposal.draft_tokens) == 4 and proposal.parents and proposal.cached_len == len(prompt) + 1
    assert drafting.tree_loops == 1
