"""What a bad request is told, as pure functions: the OpenAI API's 400 messages name the field as
the request wrote it, an unsupported field's hint is its own, and a chat role must be one the
templates render."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.api.openai_protocol import (ChatCompletionRequest, CompletionRequest, field_path,
                                             unsupported_message, validation_message)
from coordinator.chat import CHAT_ROLES, render_messages
from specdec.errors import InvalidArgument
from specdec_cli.tiny import byte_level_tokenizer


def message_of(kind, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as error:
        kind.model_validate(body, strict=True)
    return validation_message(kind, error.value)


@pytest.mark.parametrize("kind, body, expected", [
    (CompletionRequest, {"prompt": 5}, ("prompt: Input should be a valid string or a valid list, got 5", "prompt")),
    (CompletionRequest, {"prompt": "x", "stop": 3}, ("stop: Input should be a valid string or a valid list, got 3",
                                                    "stop")),
    (CompletionRequest, {"prompt": "x", "max_tokens": "4"}, ('max_tokens: Input should be a valid integer, got "4"',
                                                            "max_tokens")),
    (CompletionRequest, {}, ("prompt: Field required", "prompt")),
    (ChatCompletionRequest, {"messages": [{"role": 5}]}, ("messages[0].role: Input should be a valid string, got 5",
                                                         "messages")),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     ("top_logprobs needs logprobs: true", None)),
])
def test_a_400_names_the_field_as_the_request_wrote_it(kind, body, expected):
    assert message_of(kind, {"model": "m", **body}) == expected


def test_union_branches_and_validator_tags_are_left_out_of_the_path():
    assert field_path(CompletionRequest, ("prompt", "list[int]", 2)) == "prompt[2]"
    assert field_path(ChatCompletionRequest, ("messages", 1, "content", "str")) == "messages[1].content"


def test_each_unsupported_field_gets_its_own_neutral_value():
    assert unsupported_message("presence_penalty") == "presence_penalty is not supported yet: leave it unset or 0"
    assert unsupported_message("n") == "n is not supported yet: leave it unset or 1"
    assert "n and best_of" not in unsupported_message("frequency_penalty")


@pytest.mark.parametrize("role", ["wizard", "developer", "USER", ""])
def test_a_chat_role_outside_the_known_ones_is_refused_naming_it(role):
    with pytest.raises(InvalidArgument) as error:
        render_messages(byte_level_tokenizer(), [("user", "hi"), (role, "x")], continuing=False)
    assert f"a message's role is one of {', '.join(CHAT_ROLES)}" in str(error.value)
    assert (f"unknown chat role {role!r}" if role else "without a role") in str(error.value)


def test_the_known_roles_render():
    ids = render_messages(byte_level_tokenizer(), [(role, "hi") for role in CHAT_ROLES], continuing=False)
    assert ids
