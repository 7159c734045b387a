"""Config: one frozen dataclass per service, flags over env over defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specdec.config import CoordinatorConfig, DraftConfig, add_arguments, from_sources
from specdec_cli.main import build_parser


def parse(cls, prefix, argv, env):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, prefix)
    return from_sources(cls, prefix, vars(parser.parse_args(argv)), env)


def test_flag_beats_env_beats_default():
    config = parse(DraftConfig, "draft", ["--port", "7001"],
                   {"SPECDEC_DRAFT_PORT": "7002", "SPECDEC_DRAFT_DTYPE": "float16"})
    assert config.port == 7001 and config.dtype == "float16" and config.max_sessions == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1


def test_every_field_has_help_and_flag():
    parser = build_parser()
    text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    assert "draft" in text and "coordinator" in text
    for cls in (DraftConfig, CoordinatorConfig):
        for field in dataclasses.fields(cls):
            assert field.metadata.get("help"), field.name


@pytest.mark.parametrize("argv, env, words", [
    (["--dtype", "int8"], {}, "invalid choice"),
    ([], {"SPECDEC_DRAFT_DTYPE": "int8"}, "SPECDEC_DRAFT_DTYPE"),
    ([], {"SPECDEC_DRAFT_PORT": "abc"}, "SPECDEC_DRAFT_PORT"),
    ([], {"SPECDEC_DRAFT_TRUST_REMOTE_CODE": "maybe"}, "not a boolean"),
])
def test_bad_values_are_named(argv, env, words, capsys):
    with pytest.raises(SystemExit) as info:
        parse(DraftConfig, "draft", argv, env)
    assert words in str(info.value) + capsys.readouterr().err


def test_boolean_env_and_flag():
    assert parse(DraftConfig, "draft", [], {"SPECDEC_DRAFT_TRUST_REMOTE_CODE": "true"}).trust_remote_code
    assert not parse(DraftConfig, "draft", ["--no-trust-remote-code"],
                     {"SPECDEC_DRAFT_TRUST_REMOTE_CODE": "true"}).trust_remote_code


def test_served_model_name_takes_several_names_as_vllm_does():
    from coordinator.api.openai_protocol import served_model_names

    config = parse(CoordinatorConfig, "coordinator", ["--served-model-name", "qwen", "gpt-4o"], {})
    assert served_model_names(config.served_model_name, "/cache/x") == ("qwen", "gpt-4o")
    config = parse(CoordinatorConfig, "coordinator", [], {"SPECDEC_COORDINATOR_SERVED_MODEL_NAME": "a, b"})
    assert served_model_names(config.served_model_name, "/cache/x") == ("a", "b")
    # the default: the target's model, never a file system path
    default = parse(CoordinatorConfig, "coordinator", [], {}).served_model_name
    assert served_model_names(default, "/root/.cache/specdec/qwen2.5-0.5b-instruct-q4_k_m.gguf") \
        == ("qwen2.5-0.5b-instruct-q4_k_m",)
    assert served_model_names(default, "/root/.cache/specdec/Qwen2.5-0.5B-Instruct/") == ("Qwen2.5-0.5B-Instruct",)
    assert served_model_names(default, "./models/target") == ("target",)
    assert served_model_names(default, "Qwen/Qwen2.5-Coder-1.5B-Instruct") == ("Qwen/Qwen2.5-Coder-1.5B-Instruct",)
