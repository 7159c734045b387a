"""Field names per interface (specdec/fields.py): an error about a field reads as the interface names it."""

from __future__ import annotations

import pytest

from specdec.errors import InvalidArgument
from specdec.fields import CLI, HTTP_COMPLETIONS, Field, name, reword
from specdec.types import SamplingParams


def test_reword_names_each_interfaces_field_and_leaves_quoted_values():
    message = "max_new_tokens must be in [1, 4096], got 0"
    assert reword(message, HTTP_COMPLETIONS) == "max_tokens must be in [1, 4096], got 0"
    assert reword(message, CLI) == "--max-new-tokens must be in [1, 4096], got 0"
    assert reword(message, {}) == message  # the gRPC API's own names
    sent = "session 'session_id' does not exist (expired or deleted); omit session_id to start a new session"
    assert reword(sent, CLI) == ("session 'session_id' does not exist (expired or deleted); omit --session "
                                 "to start a new session")
    assert reword("the coordinator's --trees; tree_nodes = 1", CLI) == "the coordinator's --trees; --tree-nodes = 1"
    assert name(Field.TOKEN_IDS, HTTP_COMPLETIONS) == "prompt" and name(None, CLI) is None


def test_domain_refusals_carry_their_field():
    with pytest.raises(InvalidArgument) as refused:
        SamplingParams(top_p=2.0).validate()
    assert refused.value.field == Field.TOP_P and str(refused.value).startswith("top_p must be")
