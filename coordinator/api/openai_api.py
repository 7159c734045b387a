"""The OpenAI-compatible HTTP API of the coordinator: JSON in, round-loop call, OpenAI's shapes out.

/v1/completions and /v1/chat/completions call RoundLoop.generate as the gRPC servicer does, so
a request generates exactly what the same gRPC request would. Errors, domain or HTTP, become
OpenAI's error body in one place (`error_reply`). Streaming is server-sent events (asgi.py); the
first chunk is awaited before the response starts, so a refused request still gets its own status.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import StarletteHTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from specdec import errors, fields
from specdec.rpc.security import bearer_token
from specdec.types import Source, SamplingParams, TokenLogprobs

from coordinator.round_loop import RoundLoop
from coordinator.api.asgi import CLIENT_CLOSED, CountedRequests, EventStream, sse, until_disconnected
from coordinator.api.openai_protocol import (FINISH_REASONS, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                         SpecdecFields, TokenText, chat_logprobs, completion_logprobs, error_body,
                                         new_id, now, specdec_object, unsupported_message, usage,
                                         validation_message)
from coordinator.request import GenerationRequest
from coordinator.rounds import Chunk
from coordinator.stats import GenerationStats

log = logging.getLogger(__name__)

M = TypeVar("M", bound=SpecdecFields)


class ApiError(Exception):
    """A refusal of the HTTP layer itself (body, model, API key): status and OpenAI's fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        self.status, self.type, self.param, self.code = status, type, param, code
        super().__init__(message)


# domain errors -> (HTTP status, OpenAI error type, code); the first match wins (subclasses first)
_DOMAIN: list[tuple[type[errors.SpecdecError], int, str, str | None]] = [
    (errors.InvalidArgument, 400, "invalid_request_error", None),
    (errors.NotFound, 404, "invalid_request_error", "not_found"),
    (errors.FailedPrecondition, 409, "invalid_request_error", "conflict"),
    (errors.ResourceExhausted, 429, "rate_limit_error", "resource_exhausted"),
    (errors.DeadlineExceeded, 504, "service_unavailable", "deadline_exceeded"),
    (errors.Unavailable, 503, "service_unavailable", "unavailable"),
]


def error_reply(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error body, headers) for any failure: the one mapping of the HTTP API."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(str(exc), exc.type, exc.param, exc.code), {}
    if isinstance(exc, errors.SpecdecError):
        for kind, status, type_, code in _DOMAIN:
            if isinstance(exc, kind):
                headers = {}
                retry_after_s = errors.retry_after_s(exc)
                if retry_after_s is not None:
                    # the gRPC trailer's value (specdec.rpc.status), and HTTP's whole seconds
                    headers = {"retry-after-ms": str(int(retry_after_s * 1000)),
                               "retry-after": str(max(1, math.ceil(retry_after_s)))}
                return status, error_body(str(exc), type_, getattr(exc, "field", None), code), headers
        return 500, error_body(f"a service failed: {exc}", "internal_error", None, "internal"), {}
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, error_body(str(exc.detail), "invalid_request_error", None, None), {}
    log.exception("OpenAI API: unexpected error", exc_info=exc)
    return 500, error_body("internal error in the coordinator (a bug; see its log)", "internal_error",
                           None, "internal"), {}


def http_refusal(exc: errors.InvalidArgument, names: fields.Names) -> ApiError:
    """A domain refusal of a request's field as the HTTP API words it: the field it sent, named in
    the message and in `param` (`max_tokens`, not the gRPC API's `max_new_tokens`)."""
    return ApiError(400, fields.reword(str(exc), names), param=fields.name(exc.field, names),
                    code="invalid_value")


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_reply(exc)
    return JSONResponse(body, status_code=status, headers=headers)


class Completions:
    """The shapes of one /v1/completions request: its response, and its stream's chunks."""

    object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, name: TokenText | None = None):
        self.model = model  # the served name the request used, echoed in `model`
        self.name = name    # names tokens in `logprobs`; None: the request asked for none
        self.sent = 0       # characters of text streamed so far (the origin of text_offset)

    def logprobs(self, entries: list[TokenLogprobs], offset: int) -> dict[str, Any] | None:
        return None if self.name is None else completion_logprobs(entries, self.name, offset)

    def carries(self, text: str, finish: str | None, entries: list[TokenLogprobs]) -> bool:
        """Whether a round-loop chunk makes a chunk of the stream (tokens whose text is held back
        still have log-probabilities to send)."""
        return bool(text) or finish is not None or (self.name is not None and bool(entries))

    def response_choice(self, text: str, finish: str | None, entries: list[TokenLogprobs]) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": self.logprobs(entries, 0)}

    def deltas(self, text: str, finish: str | None, first: bool,
               entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        """The choices of the chunks for one round-loop chunk (none when it carries nothing)."""
        if not self.carries(text, finish, entries):
            return []
        out = [{"index": 0, "text": text, "finish_reason": finish, "logprobs": self.logprobs(entries, self.sent)}]
        self.sent += len(text)
        return out


class ChatCompletions(Completions):
    object = "chat.completion"
    id_prefix = "chatcmpl"

    def logprobs(self, entries: list[TokenLogprobs], offset: int) -> dict[str, Any] | None:
        return None if self.name is None else chat_logprobs(entries, self.name)

    def response_choice(self, text: str, finish: str | None, entries: list[TokenLogprobs]) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": self.logprobs(entries, 0)}

    def deltas(self, text: str, finish: str | None, first: bool,
               entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        out = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                "logprobs": None}] if first else []
        if self.carries(text, finish, entries):
            out.append({"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish,
                        "logprobs": self.logprobs(entries, 0)})
        return out


class OpenAIApi:
    """The handlers: each reads its body, builds a GenerationRequest, and shapes what the round loop
    yields as OpenAI does."""

    def __init__(self, round_loop: RoundLoop, api_key: str | None, max_body_bytes: int,
                 served_names: tuple[str, ...]):
        self.round_loop = round_loop
        self.served_names = served_names  # what requests may name as their model; the first is the default
        self.api_key = api_key.encode("ascii") if api_key else None
        self.max_body_bytes = max_body_bytes
        self.created = now()
        self.token_text = TokenText(round_loop.tokenizer)

    # ---- the request ---------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        token = bearer_token(request.headers.items())
        how = "send the header 'Authorization: Bearer <key>' (the openai client's api_key)"
        if token is None:
            raise ApiError(401, f"missing API key: {how}", code="invalid_api_key")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), self.api_key):
            raise ApiError(401, f"invalid API key: {how} with the key of the coordinator's --api-key-file",
                           code="invalid_api_key")

    async def body(self, request: Request, kind: type[M]) -> M:
        """The request body as `kind`, checked: size, JSON, fields, model, supported options."""
        limit = self.max_body_bytes
        too_large = ApiError(413, f"the request body is over {limit} bytes (--http-max-body-bytes)",
                             code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise too_large
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "the request body nests JSON arrays or objects too deeply") from None
        try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer or protobuf takes
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                           "escape): send valid Unicode text", code="invalid_value") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            parsed = kind.model_validate(data, strict=True)  # as OpenAI's API: "4" is not a number
        except ValidationError as exc:
            message, param = validation_message(kind, exc)
            raise ApiError(400, message, param=param, code="invalid_value") from None
        if parsed.model_extra:
            log.info("OpenAI API: ignored unknown fields %s", ", ".join(sorted(parsed.model_extra)))
        if parsed.model not in self.served_names:
            raise ApiError(404, f"model {parsed.model!r} is not served here; this coordinator serves "
                           f"{' or '.join(map(repr, self.served_names))} (GET /v1/models; the coordinator's "
                           f"--served-model-name)", param="model", code="model_not_found")
        unsupported = parsed.unsupported()
        if unsupported:
            raise ApiError(400, unsupported_message(unsupported), param=unsupported, code="unsupported_parameter")
        return parsed

    @staticmethod
    def generation(body: SpecdecFields, max_tokens: int | None, **inputs: Any) -> GenerationRequest:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return GenerationRequest(
            session_id=body.session_id,
            params=SamplingParams(
                temperature=SamplingParams.temperature if body.temperature is None else body.temperature,
                top_k=body.top_k or 0, top_p=SamplingParams.top_p if body.top_p is None else body.top_p),
            seed=body.seed, max_new_tokens=max_tokens, num_speculative_tokens=body.num_speculative_tokens,
            stop=stop, ignore_eos=body.ignore_eos, proposer=Source(body.proposer) if body.proposer else None,
            cache_salt=body.cache_salt, top_logprobs=body.top_logprobs_asked(), tree_nodes=body.tree_nodes,
            **inputs)

    @staticmethod
    def prompt_input(prompt: Any) -> dict[str, Any]:
        """A completion's prompt as the round loop's input: text or token ids, one prompt only."""
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if prompt and not isinstance(prompt[0], int):  # a batch of prompts
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} prompts; send one per request",
                               param="prompt", code="unsupported_parameter")
            return OpenAIApi.prompt_input(prompt[0])
        return {"token_ids": tuple(prompt)}

    @staticmethod
    def messages_input(messages: list[ChatMessage]) -> dict[str, Any]:
        out = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ApiError(400, f"messages.{i}.content: only parts of type 'text' (with a "
                                       f"string 'text') are supported, got type {part.get('type')!r}",
                                       param="messages", code="unsupported_parameter")
                    texts.append(part["text"])
                content = "".join(texts)
            out.append((message.role, content or ""))
        return {"messages": tuple(out)}

    # ---- the response --------------------------------------------------------------------------

    async def run(self, http: Request, request: GenerationRequest, shape: Completions, stream: bool,
                  include_usage: bool, names: fields.Names) -> Response:
        """The generation as one response or as events, its refusals worded with the endpoint's
        field `names`."""
        try:
            return await self.generate(http, request, shape, stream, include_usage)
        except errors.InvalidArgument as exc:
            raise http_refusal(exc, names) from None

    async def generate(self, http: Request, request: GenerationRequest, shape: Completions, stream: bool,
                       include_usage: bool) -> Response:
        """The generation as one response or as events. Until the response begins, a client that
        goes away cancels the generation (its committed tokens stay), as a cancelled gRPC call does."""
        chunks = self.round_loop.generate(request)
        if stream:
            try:  # a refused request fails here, before any byte is sent
                first = await until_disconnected(http, anext(chunks))
            except BaseException:
                await chunks.aclose()
                raise
            if first is None:
                await chunks.aclose()
                return Response(status_code=CLIENT_CLOSED)
            return EventStream(self.events(chunks, first, shape, include_usage))
        whole = await until_disconnected(http, self.whole(chunks, shape))
        return Response(status_code=CLIENT_CLOSED) if whole is None else whole

    async def whole(self, chunks: AsyncIterator[Chunk], shape: Completions) -> JSONResponse:
        """The non-streamed response: every chunk, to the end (the round loop finishes the request
        after its last chunk)."""
        text, entries, last = "", [], None
        try:
            async for chunk in chunks:
                text += chunk.text
                entries += chunk.logprobs
                last = chunk
        finally:
            await chunks.aclose()
        assert last is not None  # the round loop's last chunk carries the finish reason
        stats = last.stats or GenerationStats()
        return JSONResponse({
            "id": new_id(shape.id_prefix), "object": shape.object, "created": now(), "model": shape.model,
            "choices": [shape.response_choice(text, FINISH_REASONS.get(last.finish_reason), entries)],
            "usage": usage(stats), "specdec": specdec_object(last.session_id, stats)})

    async def events(self, chunks: AsyncIterator[Chunk], first: Chunk, shape: Completions,
                     include_usage: bool) -> AsyncIterator[str]:
        """The SSE stream. A client that goes away cancels this generator (EventStream), and the
        round loop's generator with it: the generation stops and its committed tokens stay."""
        head = {"id": new_id(shape.id_prefix), "object": shape.object + ("" if shape.object.startswith("text")
                                                                          else ".chunk"),
                "created": now(), "model": shape.model}
        try:
            chunk, opened, last = first, False, first
            while chunk is not None:
                last = chunk
                finish = FINISH_REASONS.get(chunk.finish_reason)
                for choice in shape.deltas(chunk.text, finish, not opened, chunk.logprobs):
                    yield sse({**head, "choices": [choice],
                               "specdec": specdec_object(chunk.session_id, chunk.stats)})
                opened = True
                chunk = await anext(chunks, None)  # to the end, as in run()
            if include_usage:
                stats = last.stats or GenerationStats()
                yield sse({**head, "choices": [], "usage": usage(stats),
                           "specdec": specdec_object(last.session_id, stats)})
        except Exception as exc:  # the response has begun: the error is an event
            yield sse(error_reply(exc)[1])
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    # ---- the endpoints -------------------------------------------------------------------------

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def models(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": self.created,
                                            "owned_by": "specdec", "max_model_len": self.round_loop.context_length}
                                           for name in self.served_names]}

    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.body(request, CompletionRequest)
        generation = self.generation(body, body.max_tokens, **self.prompt_input(body.prompt))
        return await self.run(request, generation, Completions(body.model, self.names(body)), body.stream,
                              _include_usage(body), fields.HTTP_COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        body = await self.body(request, ChatCompletionRequest)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        generation = self.generation(body, max_tokens, **self.messages_input(body.messages))
        names = fields.HTTP_CHAT if body.max_completion_tokens is None else fields.HTTP_CHAT_COMPLETION_TOKENS
        return await self.run(request, generation, ChatCompletions(body.model, self.names(body)), body.stream,
                              _include_usage(body), names)

    def names(self, body: SpecdecFields) -> TokenText | None:
        """What names the tokens of the response's logprobs (None: the request asked for none)."""
        return None if body.top_logprobs_asked() is None else self.token_text


def _include_usage(body: SpecdecFields) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def create_app(round_loop: RoundLoop, api_key: str | None, max_body_bytes: int,
               served_names: tuple[str, ...]) -> FastAPI:
    """The FastAPI app of the OpenAI-compatible API over `round_loop`, answering to `served_names`."""
    api = OpenAIApi(round_loop, api_key, max_body_bytes, served_names)
    app = FastAPI(title="specdec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    routes: list[tuple[str, Callable, str]] = [
        ("/health", api.health, "GET"), ("/v1/models", api.models, "GET"),
        ("/v1/completions", api.completions, "POST"), ("/v1/chat/completions", api.chat_completions, "POST")]
    for path, handler, method in routes:
        app.add_api_route(path, handler, methods=[method])
    # specific kinds: handled inside the app; Exception: the last resort (500, logged)
    for kind in (ApiError, errors.SpecdecError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))
    app.add_middleware(CountedRequests, record=round_loop.metrics.record_http_request)
    return app
