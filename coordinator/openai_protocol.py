"""The OpenAI-compatible HTTP API's request bodies (pydantic) and response shapes.

Only what the coordinator serves is declared; an unknown field is kept (extra="allow") so the
handler can log and ignore it, as OpenAI's own API tolerates new client fields. Fields that
OpenAI defines but the coordinator does not support yet are declared so that setting them is
refused with a message naming them (`unsupported`), not silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.rounds import FinishReason
from coordinator.stats import GenerationStats

# the engine's finish reasons as OpenAI names them: the end of the text, or a length limit
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT: "length",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False  # a last chunk with `usage` (and `specdec`) and no choices


class SpecdecFields(BaseModel):
    """specdec's own fields (the openai client sends them with extra_body) and OpenAI's common ones."""

    model_config = ConfigDict(extra="allow")

    model: str                                   # must be the served model id (GET /v1/models)
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
    proposer: Literal["auto", "draft", "ngram", "none"] | None = None  # None: --default-proposer
    session_id: str = ""                         # "": a new session; set: continue that session
    cache_salt: str = ""                         # mixed into the services' K/V chunk keys
    # OpenAI fields not supported yet: refused when set to anything but their neutral value
    logprobs: Any = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def unsupported(self) -> str | None:
        """The first field set that the coordinator cannot honour yet (None: none)."""
        if self.n not in (None, 1):
            return "n"
        for name in ("logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty"):
            if getattr(self, name):  # None, False, 0, {} are the neutral values
                return name
        return None


class CompletionRequest(SpecdecFields):
    prompt: str | list[int] | list[str] | list[list[int]]  # text or token ids; one prompt only
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str                                    # system, user, assistant
    content: str | list[dict[str, Any]] | None = None  # text, or parts of type "text"


class ChatCompletionRequest(SpecdecFields):
    messages: list[ChatMessage]                  # rendered with the model's chat template
    max_completion_tokens: int | None = None     # OpenAI's newer name of max_tokens (wins over it)
    tools: list[Any] | None = None               # not supported yet
    response_format: dict[str, Any] | None = None  # only {"type": "text"}

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format"
        return super().unsupported()


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
                   draft_rounds=stats.draft_rounds, ngram_rounds=stats.ngram_rounds, rounds=stats.rounds)
    return out


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
