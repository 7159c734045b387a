"""Draft/target compatibility is decided on the ids both models can emit, and on their eos ids.

The real-world case: a GPT-2-architecture draft saved with a Qwen2-architecture target's
tokenizer files. AutoTokenizer picks Qwen2Tokenizer for the target, which adds
`<|endoftext|>` as an unk token past the model's embedding; the draft's tokenizer lacks it.
Neither model can emit that id, so the pair is compatible.

Here the service tests; the other tiers' are in tests/unit/test_compat.py and
tests/e2e/test_compat.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from coordinator.server import StartupError, start as start_coordinator
from specdec_cli import tiny
from specdec.config import CoordinatorConfig
from tests.cluster import Cluster

EOS = "</s>"  # not <|endoftext|>: the Qwen2 tokenizer class adds that one


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


def test_eos_disagreement_is_refused(mixed_pair, tmp_path):
    _, target, tokenizer = mixed_pair
    draft = _with_eos(tiny.build_model(tmp_path / "other-eos", tokenizer, "gpt2", seed=34, layers=1), [7],
                      tokenizer.convert_ids_to_tokens(7))
    message = _startup_error(str(draft), target)
    assert "eos ids [7]" in message and "on [0]" in message and "share none" in message
    assert repr(str(draft)) in message and repr(target) in message
