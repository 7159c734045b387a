"""A Generate request as a domain object: its fields, their limits, and its input as tokens.

Everything here runs before anything is committed: a request that breaks a limit is refused
with INVALID_ARGUMENT and a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.config import CoordinatorConfig
from specdec.errors import InvalidArgument
from specdec.fields import Field
from specdec.types import Source, SamplingParams, check_top_logprobs

from coordinator.chat import render_messages

MAX_STOP_STRINGS = 16
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class GenerationRequest:
    """A Generate call. Exactly one input (or none when continuing a session)."""

    session_id: str = ""                             # "" = a new session
    prompt: str | None = None                        # text, tokenized here
    token_ids: tuple[int, ...] | None = None         # the input as token ids
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), through the chat template
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None                          # None = a random seed
    max_new_tokens: int | None = None                # None = --default-max-new-tokens
    num_speculative_tokens: int | None = None        # a fixed γ; None = adaptive
    stop: tuple[str, ...] = ()                       # stop strings (excluded from the output)
    ignore_eos: bool = False                         # keep going past end-of-sequence
    proposer: Source | str | None = None             # None = the coordinator's default (the wire's and
    #                                                  the flags' name for a request's Source)
    cache_salt: str = ""                             # mixed into the services' K/V chunk keys
    top_logprobs: int | None = None                  # None: no log-probabilities; N: each token's and N more
    tree_nodes: int = 0                              # draft rounds propose a tree of this many nodes (0: --trees, 1: chains)


@dataclass(frozen=True)
class SpeculationMode:
    """A request's speculation override: its source (the request's `proposer`) and a fixed γ
    (None = adaptive)."""

    source: Source
    fixed_gamma: int | None


def request_limits(request: GenerationRequest, config: CoordinatorConfig,
                   max_gamma: int) -> tuple[int, SpeculationMode]:
    """(max_new_tokens, source and fixed γ) after defaults, validated."""
    request.params.validate()
    max_new = request.max_new_tokens
    if max_new is None:
        max_new = config.default_max_new_tokens
    if not 1 <= max_new <= config.max_new_tokens_limit:
        raise InvalidArgument(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}], got {max_new}",
                              Field.MAX_NEW_TOKENS)
    gamma = request.num_speculative_tokens  # None: adaptive
    if gamma is not None and not 0 <= gamma <= max_gamma:
        raise InvalidArgument(
            f"num_speculative_tokens must be in [0, {max_gamma}] (0 disables speculation; "
            f"leave it unset for adaptive γ), got {gamma}", Field.NUM_SPECULATIVE_TOKENS)
    name = request.proposer or config.default_proposer
    if name not in tuple(Source):
        raise InvalidArgument(
            f"proposer must be one of {', '.join(Source)} (PROPOSER_AUTO, PROPOSER_DRAFT, "
            f"PROPOSER_NGRAM, PROPOSER_NONE, PROPOSER_HEADS), got {name!r}", Field.PROPOSER)
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
                              f"got {len(request.cache_salt)}", Field.CACHE_SALT)
    check_top_logprobs(request.top_logprobs)
    if not 0 <= request.tree_nodes <= max_gamma:
        raise InvalidArgument(f"tree_nodes must be in [0, {max_gamma}] (0: the coordinator's --trees, 1: chains; "
                              f"the nodes a draft-model round proposes as a tree), got {request.tree_nodes}",
                              Field.TREE_NODES)
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}", Field.STOP)
    return max_new, SpeculationMode(Source(name), gamma)


@dataclass(frozen=True)
class InputEncoder:
    """A request's input as token ids both models can take, within the context's room."""

    tokenizer: Any          # the coordinator's tokenizer (the target's)
    vocab_limit: int        # ids below this are ones both models can take
    max_prompt_tokens: int  # the longest input one request may add
    context_length: int     # the target's context, in tokens

    def encode(self, request: GenerationRequest, continuing: bool) -> list[int]:
        """The request's input as token ids (possibly empty when continuing)."""
        if request.prompt is not None:
            if not request.prompt and not continuing:
                raise InvalidArgument("prompt is empty: give some text", Field.PROMPT)
            return list(self.tokenizer(request.prompt, add_special_tokens=not continuing)["input_ids"])
        if request.messages is not None:
            return render_messages(self.tokenizer, request.messages, continuing)
        if request.token_ids is not None:
            ids = list(request.token_ids)
            if not ids and not continuing:
                raise InvalidArgument("token_ids is empty: give at least one token", Field.TOKEN_IDS)
            return ids
        if not continuing:
            raise InvalidArgument("no input: set prompt, token_ids or messages", Field.PROMPT)
        return []

    @staticmethod
    def field(request: GenerationRequest) -> Field:
        """The field that holds the request's input (prompt when it has none)."""
        if request.token_ids is not None:
            return Field.TOKEN_IDS
        return Field.MESSAGES if request.messages is not None else Field.PROMPT

    def check_ids(self, ids: list[int], field: Field) -> list[int]:
        """Every input id must be one both models can take (a text prompt can encode to an added
        token past a model's embedding): refused before anything is committed."""
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:
            raise InvalidArgument(f"the input holds token ids outside the vocabulary both models share "
                                  f"[0, {self.vocab_limit}): {bad[:5]}", field)
        return ids

    def check_length(self, committed: int, added: int, field: Field = Field.PROMPT) -> None:
        """A session of `committed` tokens may take `added` more (from `field`)."""
        if added > self.max_prompt_tokens:
            raise InvalidArgument(
                f"{field} is {added} tokens; the limit is {self.max_prompt_tokens} "
                f"(model context {self.context_length})", field)
        if committed + added >= self.context_length:
            raise InvalidArgument(
                f"session holds {committed} tokens; adding {added} of {field} leaves no room in the model "
                f"context of {self.context_length} tokens: start a new session", field)

    def input_ids(self, request: GenerationRequest, committed: int) -> list[int]:
        """The request's checked input for a session holding `committed` tokens."""
        field = self.field(request)
        added = self.check_ids(self.encode(request, continuing=committed > 0), field)
        self.check_length(committed, len(added), field)
        return added
