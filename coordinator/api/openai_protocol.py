"""The OpenAI-compatible HTTP API's request bodies (pydantic) and response shapes.

Only what the coordinator serves is declared; an unknown field is kept (extra="allow") so the
handler can log and ignore it, as OpenAI's own API tolerates new client fields. Fields that
OpenAI defines but the coordinator does not support yet are declared so that setting them is
refused with a message naming them (`unsupported`), not silently ignored.
"""

from __future__ import annotations

import json
import os
import re
import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specdec.config import names_of
from specdec.types import MAX_TOP_LOGPROBS, TokenLogprobs

from coordinator.rounds import FinishReason
from coordinator.stats import GenerationStats

MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs: OpenAI's limit (chat's top_logprobs: 20)

# the round loop's finish reasons as OpenAI names them: the end of the text, or a length limit
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT: "length",
}


def default_model_name(model_id: str) -> str:
    """The name a model is served under by default: a hub id ("Qwen/Qwen2.5-0.5B") as it is, a
    path (a directory, a .gguf file; one that exists here, as `tiny/target`, is one) by its base
    name less .gguf: never a file system path."""
    is_path = (os.path.isabs(model_id) or model_id.startswith((".", "~")) or model_id.count("/") > 1
               or model_id.endswith(".gguf") or os.path.exists(os.path.expanduser(model_id)))
    if not is_path:
        return model_id
    base = os.path.basename(model_id.rstrip("/")) or model_id
    return base.removesuffix(".gguf") or base


def served_model_names(configured: str, model_id: str) -> tuple[str, ...]:
    """The names the API answers to (--served-model-name, comma-separated), else the default."""
    return names_of(configured) or (default_model_name(model_id),)


# what an OpenAI field not supported yet may be set to all the same: its neutral value
NEUTRAL_VALUES = {"n": "1", "best_of": "1", "logit_bias": "{}", "presence_penalty": "0",
                  "frequency_penalty": "0", "echo": "false", "suffix": '""', "tools": "[]",
                  "response_format": '{"type": "text"}'}


def unsupported_message(name: str) -> str:
    """The 400 message of a field set that the coordinator cannot honour yet."""
    neutral = NEUTRAL_VALUES.get(name)
    return f"{name} is not supported yet: leave it unset" + (f" or {neutral}" if neutral else "")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (list[ChatMessage] -> ChatMessage), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in typing.get_args(annotation) if (found := _model_in(arg))), None)


def field_path(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """A validation error's location as the request wrote it (messages[0].role): field names and
    list indexes, without pydantic's union branches (prompt.str) or validator tags."""
    path, current = "", model
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif current is not None and part in current.model_fields:
            path += ("." if path else "") + part
            current = _model_in(current.model_fields[part].annotation)
    return path


def validation_message(model: type[BaseModel], error: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a request body that fails validation: the first field at fault as
    written, what every type it may take says (a union's branches in one line), what was sent."""
    errors = error.errors()
    where = field_path(model, tuple(errors[0]["loc"]))
    said: list[str] = []
    for each in errors:
        text = each["msg"] if not said else each["msg"].removeprefix("Input should be ")
        if field_path(model, tuple(each["loc"])) == where and text not in said:
            said.append(text)
    got = errors[0].get("input")
    sent = json.dumps(got) if isinstance(got, (str, int, float, bool)) else ""
    sent = f", got {sent}" if sent and len(sent) <= 80 else ""
    if not where:  # a check across fields (a model validator): its own message says which
        return " or ".join(said).removeprefix("Value error, "), None
    return f"{where}: {' or '.join(said)}{sent}", where.split(".")[0].split("[")[0]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False  # a last chunk with `usage` (and `specdec`) and no choices


class SpecdecFields(BaseModel):
    """specdec's own fields (the openai client sends them with extra_body) and OpenAI's common ones."""

    model_config = ConfigDict(extra="allow")

    model: str                                   # one of the served names (GET /v1/models)
    max_tokens: int | None = None                # None: the coordinator's --default-max-new-tokens
    temperature: float | None = None             # None: 1.0; 0 is greedy
    top_p: float | None = None                   # None: 1.0 (off)
    seed: int | None = Field(None, ge=0, lt=1 << 64)  # None: a random seed (an unsigned 64-bit int)
    stop: str | list[str] | None = None          # stop strings, excluded from the text
    stream: bool = False                         # server-sent events instead of one response
    stream_options: StreamOptions | None = None  # with stream: include_usage
    n: int | None = None                         # choices per prompt: only 1
    user: str | None = None                      # accepted and ignored
    # specdec's extra fields
    top_k: int | None = None                     # None or 0: off
    ignore_eos: bool = False                     # keep generating after end-of-sequence
    num_speculative_tokens: int | None = None    # a fixed γ; None: adaptive
    proposer: Literal["auto", "draft", "ngram", "none", "heads"] | None = None  # None: --default-proposer
    session_id: str = ""                         # "": a new session; set: continue that session
    cache_salt: str = ""                         # mixed into the services' K/V chunk keys
    tree_nodes: int = Field(0, ge=0)             # draft rounds propose a tree of this many tokens (0: --trees, 1: chains)
    # OpenAI fields not supported yet: refused when set to anything but their neutral value
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def unsupported(self) -> str | None:
        """The first field set that the coordinator cannot honour yet (None: none)."""
        if self.n not in (None, 1):
            return "n"
        for name in ("logit_bias", "presence_penalty", "frequency_penalty"):
            if getattr(self, name):  # None, False, 0, {} are the neutral values
                return name
        return None

    def top_logprobs_asked(self) -> int | None:
        """The alternatives per token the request asks for (None: no log-probabilities)."""
        raise NotImplementedError


class CompletionRequest(SpecdecFields):
    prompt: str | list[int] | list[str] | list[list[int]]  # text or token ids; one prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # alternatives per token
    echo: bool = False                           # not supported yet
    suffix: str | None = None                    # not supported yet
    best_of: int | None = None                   # not supported yet (only 1)

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str                                    # system, user, assistant
    content: str | list[dict[str, Any]] | None = None  # text, or parts of type "text"


class ChatCompletionRequest(SpecdecFields):
    messages: list[ChatMessage]                  # rendered with the model's chat template
    max_completion_tokens: int | None = None     # OpenAI's newer name of max_tokens (wins over it)
    tools: list[Any] | None = None               # not supported yet
    response_format: dict[str, Any] | None = None  # only {"type": "text"}
    logprobs: bool | None = None                 # each content token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # with logprobs: alternatives per token

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format"
        return super().unsupported()

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


# ---- responses --------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(stats: GenerationStats) -> dict[str, Any]:
    """OpenAI's usage: this request's input and generated tokens; cached: the input tokens the
    target loaded from K/V chunks instead of running them."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.target_restored_tokens}}


def specdec_object(session_id: str, stats: GenerationStats | None = None) -> dict[str, Any]:
    """The `specdec` object of a response or chunk: the session, and speculation stats once known."""
    out: dict[str, Any] = {"session_id": session_id}
    if stats is not None:
        out.update(acceptance_rate=stats.acceptance_rate, tokens_per_round=stats.tokens_per_round,
                   draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
                   draft_rounds=stats.draft_rounds, ngram_rounds=stats.ngram_rounds, heads_rounds=stats.heads_rounds,
                   rounds=stats.rounds)
    return out


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token's piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_LEVEL_CHARS = _byte_level_chars()
SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece


class TokenText:
    """Tokens as OpenAI's logprobs name them: each token's own bytes (a byte-level BPE piece
    mapped back to bytes, a sentencepiece byte-fallback piece, else the token decoded alone);
    named by their text when they are whole UTF-8, else as OpenAI names the rest, 'bytes:\\xe2\\x80'."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = tokenizer.convert_tokens_to_string(["Ġ", "Ċ"]) == " \n"
        self.cache: dict[int, tuple[str, bytes]] = {}

    def raw(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.byte_level and all(ch in BYTE_LEVEL_CHARS for ch in piece):
                return bytes(BYTE_LEVEL_CHARS[ch] for ch in piece)
            if match := SENTENCEPIECE_BYTE.fullmatch(piece):
                return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def named(self, token_id: int) -> tuple[str, bytes]:
        """(the token's name, its bytes)."""
        entry = self.cache.get(token_id)
        if entry is None:
            raw = self.raw(token_id)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            entry = self.cache[token_id] = (name, raw)
        return entry

    def __call__(self, token_id: int) -> str:
        return self.named(token_id)[0]


def completion_logprobs(entries: list[TokenLogprobs], name: TokenText, offset: int) -> dict[str, Any]:
    """/v1/completions' logprobs object; text_offset counts from `offset` characters of the text."""
    tokens = [name(entry.token_id) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{name(t): lp for t, lp in entry.top} for entry in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprobs], name: TokenText) -> dict[str, Any]:
    """/v1/chat/completions' logprobs object: one `content` entry per token."""
    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = name.named(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**token(entry.token_id, entry.logprob),
                         "top_logprobs": [token(t, lp) for t, lp in entry.top]} for entry in entries],
            "refusal": None}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
