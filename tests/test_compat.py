"""Draft/target compatibility is decided on the ids both models can emit, and on their eos ids.

The real-world case: a GPT-2-architecture draft saved with a Qwen2-architecture target's
tokenizer files. AutoTokenizer picks Qwen2Tokenizer for the target, which adds
`<|endoftext|>` as an unk token past the model's embedding; the draft's tokenizer lacks it.
Neither model can emit that id, so the pair is compatible.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from coordinator.server import StartupError, start as start_coordinator
from specdec_cli import tiny
from specdec.config import CoordinatorConfig
from specdec.tokenizer import fingerprints, load_tokenizer, tokenizer_fingerprint
from specdec.v1 import target_pb2, target_pb2_grpc
from tests.cluster import Cluster
from tests.test_e2e_greedy import reference

EOS = "</s>"  # not <|endoftext|>: the Qwen2 tokenizer class adds that one
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Le café est très chaud"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory):
    """A Qwen2 target and a GPT-2 draft, saved with one tokenizer."""
    root = tmp_path_factory.mktemp("mixed")
    tokenizer = tiny.byte_level_tokenizer(eos=EOS)
    target = tiny.build_model(root / "target", tokenizer, "qwen2", seed=31)
    draft = tiny.build_model(root / "draft", tokenizer, "gpt2", seed=32, layers=1)
    return str(draft), str(target), tokenizer


def _startup_error(draft: str, target: str, draft_config: dict | None = None) -> str:
    """Start draft and target services (the draft with draft_config's settings) and a coordinator
    that must refuse them; its message."""
    cluster = Cluster(draft, target, draft=draft_config)
    cluster._start_draft(0)
    cluster._start_target(0)
    try:
        config = CoordinatorConfig(draft=f"127.0.0.1:{cluster.draft_port}",
                                   target=f"127.0.0.1:{cluster.target_port}", port=0)
        with pytest.raises(StartupError) as info:
            asyncio.run(start_coordinator(config, startup_timeout_s=10))
        return str(info.value)
    finally:
        cluster.draft.stop(None).wait()
        cluster.target.stop(None).wait()
        cluster.loop.close()


@pytest.mark.unit
def test_the_mismatch_is_real(mixed_pair):
    """Same files, different tokenizer classes: the full vocabularies differ by one entry."""
    draft, target, tokenizer = mixed_pair
    draft_tok, target_tok = load_tokenizer(draft), load_tokenizer(target)
    assert len(tokenizer) == 384
    assert len(draft_tok) == 384 and len(target_tok) == 385
    assert target_tok.convert_tokens_to_ids("<|endoftext|>") == 384
    assert tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(target_tok)
    assert tokenizer_fingerprint(draft_tok, 384) == tokenizer_fingerprint(target_tok, 384)


@pytest.mark.unit
def test_a_service_computes_each_fingerprint_once(mixed_pair):
    """A probe that timed out while the fingerprint was computed finds it at hand next time."""
    target_tok = load_tokenizer(mixed_pair[1])
    reads = []
    vocab = target_tok.get_vocab
    target_tok.get_vocab = lambda: reads.append(1) or vocab()
    fingerprint = fingerprints(target_tok)
    assert fingerprint(384) == fingerprint(384) == tokenizer_fingerprint(load_tokenizer(mixed_pair[1]), 384)
    assert fingerprint(None) != fingerprint(384) and fingerprint(None) == fingerprint(None)
    assert len(reads) == 2  # one per limit


@pytest.mark.e2e
def test_mixed_architectures_with_one_tokenizer_are_accepted_and_exact(mixed_pair):
    draft, target, _ = mixed_pair
    expected = reference(target, PROMPTS, NEW_TOKENS)
    with Cluster(draft, target) as cluster:
        for gamma in (1, 4):
            for prompt in PROMPTS:
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS,
                                            num_speculative_tokens=gamma, ignore_eos=True)
                assert list(response.token_ids) == expected[prompt], (gamma, prompt)
                assert response.stats.draft_tokens > 0
        # the services fingerprint the ids below the size asked for; 0 is refused precisely
        with grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            full = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=10).info
            cut = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(fingerprint_vocab_size=100),
                                    timeout=10).info
            assert full.vocab_size == 384 and full.tokenizer_vocab_size == 385
            assert full.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(target), 384)
            assert cut.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(target), 100)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(fingerprint_vocab_size=0),
                                  timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fingerprint_vocab_size" in info.value.details()


def _permuted(tokenizer, a: int, b: int):
    """The same tokenizer with the ids of two tokens swapped."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)),
                                   eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token)


@pytest.mark.service
def test_permuted_vocabulary_is_refused(mixed_pair, tmp_path):
    _, target, tokenizer = mixed_pair
    permuted = _permuted(tokenizer, 200, 201)
    assert len(permuted) == len(tokenizer) and permuted.eos_token_id == tokenizer.eos_token_id
    draft = tiny.build_model(tmp_path / "permuted", permuted, "gpt2", seed=33, layers=1)
    message = _startup_error(str(draft), target)
    assert "different tokenizers" in message
    assert repr(str(draft)) in message and repr(target) in message
    assert "384 tokens" in message and "385 tokens" in message


def _with_eos(draft: Path, eos_ids: list[int], tokenizer_eos: str | None = None) -> Path:
    """The checkpoint's generation config ends on eos_ids (and its tokenizer on tokenizer_eos)."""
    generation = draft / "generation_config.json"
    config = json.loads(generation.read_text())
    config["eos_token_id"] = eos_ids
    generation.write_text(json.dumps(config))
    if tokenizer_eos is not None:
        tokenizer_config = json.loads((draft / "tokenizer_config.json").read_text())
        tokenizer_config["eos_token"] = tokenizer_eos
        (draft / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return draft


@pytest.mark.service
def test_eos_disagreement_is_refused(mixed_pair, tmp_path):
    _, target, tokenizer = mixed_pair
    draft = _with_eos(tiny.build_model(tmp_path / "other-eos", tokenizer, "gpt2", seed=34, layers=1), [7],
                      tokenizer.convert_ids_to_tokens(7))
    message = _startup_error(str(draft), target)
    assert "eos ids [7]" in message and "on [0]" in message and "share none" in message
    assert repr(str(draft)) in message and repr(target) in message


@pytest.mark.e2e
def test_a_draft_with_more_eos_ids_is_accepted_and_only_the_targets_end_generation(mixed_pair, tmp_path):
    """A draft that also ends on a token the target emits (as llama.cpp's end-of-generation set
    adds ids to a checkpoint's eos) is accepted, and that token ends nothing."""
    _, target, tokenizer = mixed_pair
    expected = reference(target, [PROMPTS[0]], NEW_TOKENS)[PROMPTS[0]]
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stop = expected.index(eos) + 1 if eos in expected else NEW_TOKENS
    extra = expected[0]
    assert extra != eos and stop > 1
    draft = _with_eos(tiny.build_model(tmp_path / "more-eos", tokenizer, "gpt2", seed=35, layers=1),
                      [eos, extra])
    with Cluster(str(draft), target) as cluster:
        reply = cluster.complete(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS, num_speculative_tokens=3)
    assert list(reply.token_ids) == expected[:stop]
