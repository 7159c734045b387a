"""The llama.cpp engine under the torch engine's exactness tests.

Tiny random Llama checkpoints written as float32 GGUF files; every service runs them through
llama-cpp-python. Greedy speculative output equals greedy target-only output through the same
engine, token for token, alone and batched; sampled output follows the target's distribution
(computed from the llama.cpp target's own logits); rollback, eviction and cache misses; and a
mixed deployment (a torch draft and a llama.cpp target, or the other way round) accepted when
the vocabularies agree and refused when they do not.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

from specdec_cli import tiny
from specdec.runtime.engines import resolve_backend
from specdec.runtime.llama_cpp.engine import LlamaOptions, LlamaCppEngine
from specdec.runtime.session_kv import Row
from specdec.maths.sampling import target_probs
from specdec.tokenizer import ModelLoadError
from specdec.types import Backend, SamplingParams
from tests.cluster import Cluster
from tests.gguf_writer import write_llama_gguf
from specdec.v1 import coordinator_pb2
from tests.test_sampling import chi2_pvalue

# greedy paths whose top-two logit gap stays above llama.cpp's batch-shape noise (see
# test_batched_sessions_match_their_runs_alone); "A target verifies 🚀" has a 0.0017 tie at token 14
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Le café est très chaud", "for i in range(10):"]
MIN_MARGIN = 0.005  # logits: several times the 1.5e-3 that batch shapes move them by
NEW_TOKENS = 24
NONE, DRAFT = coordinator_pb2.PROPOSER_NONE, coordinator_pb2.PROPOSER_DRAFT
# llama.cpp's float32 kernels differ with the batch shape: logits agree to about 1e-4 of their range
TOLERANCE = 1e-3
LLAMA = {"backend": "llama.cpp", "kv_cache_type": "f32", "kv_cache_tokens": 4096}


@pytest.fixture(scope="module")
def gguf_pair(models, tmp_path_factory):
    """The tiny Llama target and draft of `models`, as float32 GGUF files."""
    root = tmp_path_factory.mktemp("gguf")
    return {role: str(write_llama_gguf(models["llama"][role], root / f"{role}.gguf")) for role in ("target", "draft")}


@pytest.fixture(scope="module")
def engine(gguf_pair):
    engine = LlamaCppEngine(gguf_pair["target"], 8, 1 << 30, 16, 512,
                            LlamaOptions(kv_cache_type="f32", kv_cache_tokens=1024))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llama_pair_cluster(gguf_pair):
    with Cluster(gguf_pair["draft"], gguf_pair["target"], draft=LLAMA, target=LLAMA) as cluster:
        yield cluster


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text)["input_ids"]


def _fresh(engine, session_id: str):
    engine.release(session_id)
    engine.finish(())  # a finished call: the released sequence is cleared
    entry = engine.new_entry()
    engine.caches.put(session_id, entry)
    return entry


@pytest.mark.unit
def test_backend_choice():
    assert resolve_backend("auto", "m.gguf", llama_cpp_available=True) == Backend.LLAMA_CPP
    assert resolve_backend("auto", "m.gguf", llama_cpp_available=False) == Backend.TORCH
    assert resolve_backend("auto", "some/dir", llama_cpp_available=True) == Backend.TORCH
    assert resolve_backend("torch", "m.gguf") == Backend.TORCH
    with pytest.raises(ModelLoadError, match="serves a .gguf file"):
        resolve_backend("llama.cpp", "some/dir")
    with pytest.raises(ModelLoadError, match="unknown backend"):
        resolve_backend("onnx", "m.gguf")


@pytest.mark.unit
def test_batched_sequences_and_rollback_agree_with_one_session(engine):
    ids = _ids(engine, " ".join(PROMPTS))
    assert len(ids) >= 10
    alone = engine.forward("a", _fresh(engine, "a"), ids, len(ids))  # [n, vocab]
    assert alone.shape == (len(ids), engine.vocab_size) and alone.dtype == torch.float32
    # token by token (what target-only decoding runs) against the one forward (what verification runs)
    entry = _fresh(engine, "b")
    stepped = torch.cat([engine.forward("b", entry, [t], 1) for t in ids])
    assert torch.allclose(stepped, alone, atol=TOLERANCE * float(alone.abs().max()))
    # two sessions of different lengths in one decode
    first, second = _fresh(engine, "c"), _fresh(engine, "d")
    together = engine.forward_batch([Row("c", first, ids, len(ids)), Row("d", second, ids[:5], 2)])
    assert torch.allclose(together[0], alone, atol=TOLERANCE * float(alone.abs().max()))
    assert torch.allclose(together[1], alone[3:5], atol=TOLERANCE * float(alone.abs().max()))
    # rollback: drop the last positions, run other tokens, then the original ones again
    assert first.crop(4) and len(first) == 4
    other = engine.forward("c", first, [7, 8, 9], 3)
    assert not torch.allclose(other, alone[4:7])
    assert first.crop(4)
    again = engine.forward("c", first, ids[4:], len(ids) - 4)
    assert torch.allclose(again, alone[4:], atol=TOLERANCE * float(alone.abs().max()))
    assert engine.tokens_run > 0 and len(engine.caches) == 4


#        root                n0 the chain, n1 an alternative under the root; n3 beside n2
#       /    \
#     n0      n1
#     /  \     |
#   n2   n3   n4
#    |
#   n5
TREE_PARENTS = (0, 0, 1, 1, 2, 3)


@pytest.mark.unit
def test_a_tree_forward_scores_each_node_as_its_path_alone(engine):
    """One decode of a tree beside a chain: each node's logits are those of its own path run
    alone (sequence sets mask it to the history and its ancestors); keep_path leaves the session
    holding exactly the history and the accepted path, and frees the spare sequences."""
    from specdec.maths.tree import TokenTree

    history = _ids(engine, PROMPTS[0])
    nodes = (11, 12, 13, 14, 15, 16)
    tree = TokenTree(nodes, TREE_PARENTS)
    free = len(engine.free)
    entry, beside = _fresh(engine, "tree"), _fresh(engine, "chain")
    engine.forward("tree", entry, history[:-2], 1)  # part of the history in the cache already
    out = engine.forward_batch([Row("tree", entry, history[-2:] + list(nodes), 1 + len(tree), tree),
                                Row("chain", beside, history, 3)])
    assert len(engine.free) == free - 2 - 3  # two sessions, three leaves (n4, n5 and n3)
    scale = TOLERANCE * float(out[0].abs().max())
    for node in range(len(tree)):
        path = [nodes[i] for i in tree.path(node)]
        alone = engine.forward("alone", _fresh(engine, "alone"), history + path, 1)
        assert torch.allclose(out[0][1 + node], alone[0], atol=scale), node
    root = engine.forward("alone", _fresh(engine, "alone"), history, 1)
    assert torch.allclose(out[0][0], root[0], atol=scale)
    # keep n1 -> n4: the session then continues as if history + n1 n4 had been fed
    engine.keep_path(entry, len(history), [1, 4])
    assert list(entry.tokens) == history + [12, 15] and entry.kv.length == len(history) + 2
    assert len(engine.free) == free - 3  # the leaves' sequences are free again ("alone" holds one)
    after = engine.forward("tree", entry, [17], 1)
    fresh = engine.forward("alone", _fresh(engine, "alone"), history + [12, 15, 17], 1)
    assert torch.allclose(after, fresh, atol=scale)
    # a path of nothing: the history only
    entry2 = _fresh(engine, "tree2")
    engine.forward_batch([Row("tree2", entry2, history + list(nodes), 1 + len(tree), tree)])
    engine.keep_path(entry2, len(history), [])
    assert list(entry2.tokens) == history and entry2.kv.length == len(history)
    assert torch.allclose(engine.forward("tree2", entry2, [17], 1),
                          engine.forward("alone", _fresh(engine, "alone"), history + [17], 1), atol=scale)


@pytest.mark.unit
def test_released_and_evicted_sequences_are_reused(gguf_pair):
    engine = LlamaCppEngine(gguf_pair["target"], 3, 1 << 30, 16, 512,
                            LlamaOptions(kv_cache_type="f32", kv_cache_tokens=256))
    try:
        free = len(engine.free)
        ids = list(range(1, 41))
        for name in "abcd":  # four sessions, at most three kept
            entry, feed = engine.begin(name, 0, 0, ids)
            engine.forward(name, entry, feed, 1)
            engine.finish(name)
        assert "a" not in engine.caches and len(engine.caches) == 3
        assert len(engine.free) == free - 3  # the evicted one's sequence is free again
        assert engine.release("b")
        engine.finish(())
        assert len(engine.free) == free - 2
        # 256 cells: a 230-token session evicts the two others (40 tokens each) rather than overflow
        entry, feed = engine.begin("big", 0, 0, list(range(1, 231)))
        engine.forward("big", entry, feed, 1)
        engine.finish("big")
        assert list(engine.caches._entries) == ["big"]
        assert engine.caches.total_bytes() == 230 * engine.bytes_per_token
    finally:
        engine.close()


@pytest.mark.e2e
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_speculation_equals_target_only_through_llama_cpp(llama_pair_cluster, gamma):
    for prompt in PROMPTS:
        plain = llama_pair_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=NONE,
                                            ignore_eos=True)
        assert plain.stats.draft_tokens == 0 and len(plain.token_ids) == NEW_TOKENS
        spec = llama_pair_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=DRAFT,
                                           num_speculative_tokens=gamma, ignore_eos=True)
        assert list(spec.token_ids) == list(plain.token_ids), prompt
        assert spec.stats.draft_tokens > 0


def _greedy_margin(engine, text: str, steps: int) -> float:
    """The smallest top-two logit gap along the target's greedy path from `text`."""
    entry = _fresh(engine, "margin")
    logits, gaps = engine.forward("margin", entry, _ids(engine, text), 1), []
    for _ in range(steps):
        top = torch.topk(logits[-1], 2)
        gaps.append(float(top.values[0] - top.values[1]))
        logits = engine.forward("margin", entry, [int(top.indices[0])], 1)
    return min(gaps)


@pytest.mark.e2e
def test_batched_sessions_match_their_runs_alone(llama_pair_cluster, engine):
    """Eight concurrent requests share the services' batched decodes; each gets its own output.

    Which sessions share a decode depends on timing, and llama.cpp's float32 logits move by
    about 1.5e-3 with the batch's shape, so a greedy near-tie could flip: the prompts' paths are
    checked to have no tie that close first."""
    for prompt in PROMPTS:
        assert _greedy_margin(engine, prompt, NEW_TOKENS) > MIN_MARGIN, prompt
    expected = {p: list(llama_pair_cluster.complete(prompt=p, max_new_tokens=NEW_TOKENS, proposer=NONE,
                                                    ignore_eos=True).token_ids) for p in PROMPTS}
    jobs = [(p, g) for p in PROMPTS for g in (2, 4)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        done = list(pool.map(lambda job: llama_pair_cluster.complete(
            prompt=job[0], max_new_tokens=NEW_TOKENS, num_speculative_tokens=job[1], ignore_eos=True), jobs))
    for (prompt, _), response in zip(jobs, done):
        assert list(response.token_ids) == expected[prompt], prompt


@pytest.mark.e2e
def test_cache_misses_resend_and_keep_the_output(gguf_pair):
    with Cluster(gguf_pair["draft"], gguf_pair["target"], draft=LLAMA, target=LLAMA) as cluster:
        expected = list(cluster.complete(prompt=PROMPTS[1], max_new_tokens=NEW_TOKENS, proposer=NONE,
                                         ignore_eos=True).token_ids)
        first = cluster.complete(prompt=PROMPTS[1], max_new_tokens=8, num_speculative_tokens=3,
                                 ignore_eos=True)
        cluster.restart_target()  # every target cache is gone
        cluster.restart_draft()
        rest = cluster.complete(max_new_tokens=NEW_TOKENS - 8, num_speculative_tokens=3, ignore_eos=True,
                                session_id=first.session_id)
        assert list(first.token_ids) + list(rest.token_ids) == expected


def _exact_first_two(engine: LlamaCppEngine, prompt: list[int], params: SamplingParams):
    """P(token 1) and P(token 2) = Σ_t P(t) P(token 2 | t), from the llama.cpp target's logits."""
    p1 = target_probs(engine.forward("p", _fresh(engine, "p"), prompt, 1), params)[0].double()  # [vocab]
    p2 = torch.zeros_like(p1)
    for token in torch.nonzero(p1 > 0).flatten().tolist():
        logits = engine.forward("p", _fresh(engine, "p"), [*prompt, token], 1)
        p2 += p1[token] * target_probs(logits, params)[0].double()
    return p1.numpy(), p2.numpy()


@pytest.mark.e2e
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=6),
                                    SamplingParams(temperature=1.5, top_k=10, top_p=0.95)],
                         ids=["t0.8-topk6", "t1.5-topk10-topp0.95"])
def test_sampled_tokens_follow_the_llama_cpp_target(llama_pair_cluster, engine, params):
    prompt = _ids(engine, "ab")
    p1, p2 = _exact_first_two(engine, prompt, params)
    samples = 600
    counts1, counts2 = np.zeros(len(p1)), np.zeros(len(p1))
    accepted = 0
    for response in llama_pair_cluster.complete_each(
            range(samples), token_ids=prompt, max_new_tokens=2, num_speculative_tokens=2, proposer=DRAFT,
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p if params.top_p < 1 else None,
            ignore_eos=True):
        first, second = response.token_ids
        counts1[first] += 1
        counts2[second] += 1
        accepted += response.stats.accepted_tokens
    assert 0 < accepted < 2 * samples  # a different draft: some drafts accepted, some not
    for counts, probs in ((counts1, p1), (counts2, p2)):
        support = probs > 1e-9
        assert counts[~support].sum() == 0, "a token outside the warped support was produced"
        assert chi2_pvalue(counts[support], probs[support]) > 1e-3, (counts, probs * samples)


@pytest.mark.e2e
def test_torch_draft_with_llama_cpp_target_is_exact(models, gguf_pair, llama_pair_cluster):
    """A mixed deployment: the draft on torch (its checkpoint directory), the target on llama.cpp."""
    with Cluster(models["llama"]["draft"], gguf_pair["target"], dtype="float32", target=LLAMA) as mixed:
        for prompt in PROMPTS[:2]:
            expected = llama_pair_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=NONE,
                                                   ignore_eos=True)
            response = mixed.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=DRAFT,
                                      num_speculative_tokens=3, ignore_eos=True)
            assert list(response.token_ids) == list(expected.token_ids)
            assert response.stats.draft_tokens > 0


@pytest.mark.e2e
def test_a_llama_cpp_target_verifies_the_torch_drafts_trees(models, gguf_pair, llama_pair_cluster):
    """Token trees from a torch draft, verified in one llama.cpp decode: greedy output equals the
    llama.cpp target's own, several tree shapes at once. A llama.cpp draft grows chains only."""
    with Cluster(models["llama"]["draft"], gguf_pair["target"], dtype="float32", target=LLAMA) as mixed:
        assert mixed.coordinator.round_loop.target_info.verifies_trees
        expected = {prompt: list(llama_pair_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=NONE,
                                                             ignore_eos=True).token_ids) for prompt in PROMPTS[:2]}
        shapes = [(2, 4), (4, 8), (3, 3)]
        with concurrent.futures.ThreadPoolExecutor(len(shapes) * 2) as pool:
            futures = {(prompt, shape): pool.submit(
                mixed.complete, prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=DRAFT,
                num_speculative_tokens=shape[0], tree_nodes=shape[1], ignore_eos=True)
                for prompt in expected for shape in shapes}
        for (prompt, shape), future in futures.items():
            response = future.result()
            assert list(response.token_ids) == expected[prompt], (prompt, shape)
            assert response.stats.tree_rounds > 0
    assert not llama_pair_cluster.coordinator.round_loop.draft_info.verifies_trees  # grows no trees


@pytest.mark.e2e
def test_llama_cpp_draft_with_torch_target_is_exact(models, tmp_path):
    """The other mixed deployment: the draft on llama.cpp, the target on torch. The GGUF marks an
    end-of-turn id, so llama.cpp's end-of-generation set is larger than the target's eos ids (as
    with the real Qwen pair's files): accepted, and only the target's ids end generation."""
    draft = str(write_llama_gguf(models["llama"]["draft"], tmp_path / "draft.gguf", eot_token_id=7))
    with Cluster(draft, models["llama"]["target"], dtype="float32", draft=LLAMA) as mixed:
        for prompt in PROMPTS[:2]:
            expected = mixed.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=NONE, ignore_eos=True)
            response = mixed.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, proposer=DRAFT,
                                      num_speculative_tokens=3, ignore_eos=True)
            assert list(response.token_ids) == list(expected.token_ids)
            assert response.stats.draft_tokens > 0
        draft_eos = set(mixed.draft_servicer.engine.description.eos_token_ids)
    assert 7 in draft_eos and len(draft_eos) >= 2


@pytest.mark.service
def test_llama_cpp_draft_of_another_vocabulary_is_refused(models, tmp_path):
    from tests.test_compat import _permuted, _startup_error

    permuted = _permuted(tiny.byte_level_tokenizer(), 200, 201)  # two ids swapped
    other = tiny.build_model(tmp_path / "other", permuted, "llama", seed=5, layers=1)
    draft = str(write_llama_gguf(other, tmp_path / "other.gguf"))
    message = _startup_error(draft, models["llama"]["target"], LLAMA)
    assert "different tokenizers" in message and repr(draft) in message
