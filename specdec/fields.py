"""A generation request's fields as each interface names them: the one mapping of field names.

The domain (GenerationRequest, specdec.errors) and the gRPC API share one name per field
(`max_new_tokens`); the OpenAI-compatible HTTP API and the `specdec generate` command name some
of them otherwise (`max_tokens`, `--max-new-tokens`). An error about a field is written with the
domain's name, carries it (`InvalidArgument.field`), and is reworded for the interface that
reports it, so a user reads the name they sent.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Mapping


class Field(StrEnum):
    """A request field, as GenerationRequest and the gRPC API name it."""

    SESSION_ID = "session_id"
    PROMPT = "prompt"
    TOKEN_IDS = "token_ids"
    MESSAGES = "messages"
    MAX_NEW_TOKENS = "max_new_tokens"
    NUM_SPECULATIVE_TOKENS = "num_speculative_tokens"
    PROPOSER = "proposer"
    TEMPERATURE = "temperature"
    TOP_K = "top_k"
    TOP_P = "top_p"
    SEED = "seed"
    STOP = "stop"
    CACHE_SALT = "cache_salt"
    TOP_LOGPROBS = "top_logprobs"
    TREE_NODES = "tree_nodes"


Names = Mapping[str, str]  # a Field's value -> the interface's name; a field left out keeps its own

# the OpenAI-compatible API: /v1/completions takes token ids in `prompt` and counts alternatives in
# `logprobs`; /v1/chat/completions' `max_completion_tokens`, when a request sends it, wins over this
HTTP_COMPLETIONS: Names = {Field.TOKEN_IDS: "prompt", Field.MAX_NEW_TOKENS: "max_tokens",
                           Field.TOP_LOGPROBS: "logprobs"}
HTTP_CHAT: Names = {Field.MAX_NEW_TOKENS: "max_tokens"}
HTTP_CHAT_COMPLETION_TOKENS: Names = {**HTTP_CHAT, Field.MAX_NEW_TOKENS: "max_completion_tokens"}
# `specdec generate`: its flags (the prompt is its positional argument)
CLI: Names = {Field.SESSION_ID: "--session", Field.MAX_NEW_TOKENS: "--max-new-tokens",
              Field.NUM_SPECULATIVE_TOKENS: "--gamma", Field.PROPOSER: "--proposer",
              Field.TEMPERATURE: "--temperature", Field.TOP_K: "--top-k", Field.TOP_P: "--top-p",
              Field.SEED: "--seed", Field.STOP: "--stop", Field.CACHE_SALT: "--cache-salt",
              Field.TREE_NODES: "--tree-nodes", Field.MESSAGES: "--chat"}

# a quoted value (left as it is: it is what the user sent), or a field's name
_WORDS = re.compile(r"(?<!\w)'[^']*'|(?<!\w)\"[^\"]*\"|\b(" + "|".join(sorted(Field, key=len, reverse=True)) + r")\b")


def name(field: str | None, names: Names) -> str | None:
    """`field` as the interface names it (None stays None)."""
    return None if field is None else names.get(field, field)


def reword(message: str, names: Names) -> str:
    """`message` with every field's domain name replaced by the interface's."""
    return _WORDS.sub(lambda m: names.get(m.group(1), m.group(1)) if m.group(1) else m.group(0), message)
