"""End to end, greedy: speculative output == target.generate(do_sample=False), token for token.

Tiny random models (Llama and GPT-2 configs), float64, real gRPC servers on loopback. These
drive the draft model at fixed γ; tests/test_sources.py covers prompt lookup and adaptive γ.
"""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.loader import load_model
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster

pytestmark = pytest.mark.e2e

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "Le café est très chaud",
    "for i in range(10):",
    "A target model verifies 🚀",
]
NEW_TOKENS = 32
GAMMAS = (1, 3, 5)


def reference(target_dir: str, prompts: list[str], new_tokens: int) -> dict[str, list[int]]:
    """What the target alone produces: transformers' greedy generate, EOS ignored."""
    loaded = load_model(target_dir, "float64")
    loaded.model.generation_config.eos_token_id = None
    out = {}
    for prompt in prompts:
        ids = torch.tensor([loaded.tokenizer(prompt)["input_ids"]])
        generated = loaded.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                          do_sample=False, pad_token_id=0)
        out[prompt] = generated[0, ids.shape[1]:].tolist()
        assert len(out[prompt]) == new_tokens
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("draft_kind", ["unrelated", "identical"])
def test_greedy_equals_target_only(models, arch, draft_kind):
    target = models[arch]["target"]
    draft = models[arch]["draft"] if draft_kind == "unrelated" else target
    expected = reference(target, PROMPTS, NEW_TOKENS)
    with Cluster(draft, target) as cluster:
        for gamma in GAMMAS:
            for prompt in PROMPTS:
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS,
                                            num_speculative_tokens=gamma, ignore_eos=True,
                                            proposer=coordinator_pb2.PROPOSER_DRAFT)
                assert list(response.token_ids) == expected[prompt], (arch, draft_kind, gamma, prompt)
                stats = response.stats
                assert stats.generated_tokens == NEW_TOKENS
                assert stats.rounds * 1 <= NEW_TOKENS
                if draft_kind == "identical":
                    # every draft accepted; each round yields γ+1 tokens (the last round may be cut short)
                    assert stats.acceptance_rate == 1.0, stats
                    assert stats.rounds == -(-NEW_TOKENS // (gamma + 1)), stats
                    assert stats.tokens_per_round > gamma
                else:
                    assert stats.acceptance_rate < 0.9
            # γ = 0: plain target decoding through the same path
        baseline = cluster.complete(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS,
                                    num_speculative_tokens=0, ignore_eos=True)
        assert list(baseline.token_ids) == expected[PROMPTS[0]]
        assert baseline.stats.rounds == NEW_TOKENS and baseline.stats.draft_tokens == 0


def test_streamed_chunks_add_up_and_stop_on_eos(models):
    target = models["llama"]["target"]
    with Cluster(models["llama"]["draft"], target) as cluster:
        chunks = cluster.stream(prompt=PROMPTS[2], max_new_tokens=40, num_speculative_tokens=3,
                                ignore_eos=True)
        full = cluster.complete(prompt=PROMPTS[2], max_new_tokens=40, num_speculative_tokens=3,
                                ignore_eos=True)
        assert [t for c in chunks for t in c.token_ids] == list(full.token_ids)
        assert "".join(c.text for c in chunks) == full.text
        assert chunks[-1].finish_reason == full.finish_reason != 0
        assert all(c.finish_reason == 0 for c in chunks[:-1])
        assert chunks[-1].stats.generated_tokens == 40


def test_stop_string_ends_generation_and_is_excluded(llama_cluster):
    full = llama_cluster.complete(prompt=PROMPTS[0], max_new_tokens=32, ignore_eos=True)
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    stopped = llama_cluster.stream(prompt=PROMPTS[0], max_new_tokens=32, ignore_eos=True, stop=[stop],
                                   num_speculative_tokens=4)
    streamed = "".join(c.text for c in stopped)
    assert streamed == text[:first]
    assert stopped[-1].finish_reason == 3  # FINISH_REASON_STOP
    generated = [t for c in stopped for t in c.token_ids]
    assert generated == list(full.token_ids[: len(generated)])
    assert len(generated) < 32


def test_chat_messages_use_the_chat_template(llama_cluster, models):
    from specdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(models["llama"]["target"])
    messages = [("system", "be brief"), ("user", "say hi")]
    rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    by_chat = llama_cluster.complete(messages=messages, max_new_tokens=12, ignore_eos=True)
    by_ids = llama_cluster.complete(token_ids=ids, max_new_tokens=12, ignore_eos=True)
    assert by_chat.stats.prompt_tokens == len(ids)
    assert list(by_chat.token_ids) == list(by_ids.token_ids)


def test_eos_ends_generation(small_vocab_models):
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"]) as cluster:
        ended = 0
        for seed in range(40):
            response = cluster.complete(token_ids=[3, 7, 5], max_new_tokens=8, temperature=0.7, seed=seed)
            ids = list(response.token_ids)
            if response.finish_reason == 1:  # FINISH_REASON_EOS
                ended += 1
                assert ids[-1] == 0 and 0 not in ids[:-1]
            else:
                assert 0 not in ids and len(ids) == 8
        assert ended > 0
