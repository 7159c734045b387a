"""A checkpoint's identity (specdec/checkpoint.py): the same files anywhere are one checkpoint,
other weights written over the same path another."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.checkpoint import SLICE_BYTES, SLICES, checkpoint_id


def _write_weights(directory, seed: int, numel: int) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.randn(numel, generator=generator)}, str(directory / "model.safetensors"))


@pytest.mark.parametrize("numel", [1000, 3 * SLICES * SLICE_BYTES // 4], ids=["whole-file", "sampled"])
def test_a_copy_is_the_same_checkpoint_and_new_weights_at_the_same_path_are_not(tmp_path, numel):
    _write_weights(tmp_path / "draft", seed=0, numel=numel)
    first = checkpoint_id(str(tmp_path / "draft"))
    assert len(first) == 32
    shutil.copytree(tmp_path / "draft", tmp_path / "copy")  # another place, other times
    assert checkpoint_id(str(tmp_path / "copy")) == first
    _write_weights(tmp_path / "draft", seed=1, numel=numel)  # a fine-tune written over it: same shapes
    assert checkpoint_id(str(tmp_path / "draft")) != first
    (tmp_path / "copy" / "generation_config.json").write_text("{}")  # a file more
    assert checkpoint_id(str(tmp_path / "copy")) != first


def test_one_file_and_what_is_not_on_this_disk(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert checkpoint_id(str(gguf)) == checkpoint_id(str(gguf))
    other = tmp_path / "renamed.gguf"
    shutil.copy(gguf, other)
    assert checkpoint_id(str(other)) == checkpoint_id(str(gguf))  # a file's own name is its path's
    assert checkpoint_id("Qwen/Qwen2.5-0.5B-Instruct") == ""  # a hub id
