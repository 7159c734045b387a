"""A model argument is a path when it names something here, a hub id when it can be one; a path
that is not there fails at once (specdec.tokenizer.resolve_model, docs/models.md#other-models)."""

from __future__ import annotations

import pytest

from coordinator.api.openai_protocol import default_model_name
from specdec.tokenizer import ModelLoadError, model_source, resolve_model, why_not_a_hub_id


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory holding tiny/target (as `specdec models tiny tiny` leaves it)."""
    (tmp_path / "tiny" / "target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path


def test_a_relative_directory_is_a_path_served_by_its_last_component(here):
    assert resolve_model("tiny/target") == str(here / "tiny" / "target")
    assert model_source("tiny/target") == (str(here / "tiny" / "target"), {})
    assert default_model_name("tiny/target") == "target"
    assert default_model_name(resolve_model("tiny/target")) == "target"


@pytest.mark.parametrize("spec, why", [
    ("tiny/targt", "tiny/ is a directory here"),
    ("./target", "it is a path"),
    ("../elsewhere/target", "it is a path"),
    ("/no/such/target", "it is a path"),
    ("~/no-such-model-dir", "it is a path"),
    ("a/b/c", "a hub id is NAME or ORG/NAME"),
    ("nothing.gguf", "a .gguf file"),
])
def test_a_path_that_is_not_there_fails_before_any_hub_call(here, spec, why):
    with pytest.raises(ModelLoadError) as error:
        resolve_model(spec)
    message = str(error.value)
    assert message.startswith(f"no such {'file' if spec.endswith('.gguf') else 'directory'}: {spec} ")
    assert why in message


def test_what_can_be_a_hub_id_goes_to_the_hub(here):
    for spec in ("gpt2", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "tny/target"):
        assert why_not_a_hub_id(spec) is None and resolve_model(spec) == spec


def test_offline_a_hub_id_the_cache_lacks_is_no_such_directory(here, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(here / "hub"))
    with pytest.raises(ModelLoadError, match="no such directory: tny/target .*HF_HUB_OFFLINE"):
        resolve_model("tny/target")
    (here / "hub" / "models--Org--cached").mkdir(parents=True)
    assert resolve_model("Org/cached") == "Org/cached"
