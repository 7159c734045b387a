"""Fuzz the bodies of POST /v1/completions and /v1/chat/completions (coordinator/api/openai_api.py):
JSON objects with every field of odd values, unknown fields and garbage, and raw bodies that are
no JSON object at all. Every answer is 2xx or 4xx, never 5xx; a 4xx carries OpenAI's error JSON;
a 2xx is the endpoint's shape, a streamed one ends with `data: [DONE]`; the servers stay up."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

try:  # the HTTP client the openai package brings: httpx, or its renamed fork in newer releases
    import httpx2 as httpx
except ImportError:
    import httpx

from tests.cluster import Cluster

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LIMIT = 16  # the fuzz cluster's --max-new-tokens-limit: a longer generation is refused, fast
MODEL = "{model}"  # in a raw body: replaced by the served model id


@dataclasses.dataclass
class Call:
    """One HTTP request of the fuzz: `body` is the JSON object sent (None: a raw `content`)."""

    path: str
    body: dict[str, Any] | None = None
    content: bytes = b""
    encoding: str = "ascii"  # how `body` is serialised: ascii, utf-8, utf-16, bom
    content_type: str | None = "application/json"
    method: str = "POST"

    def payload(self, model_id: str) -> bytes:
        if self.body is None:
            return self.content.replace(MODEL.encode(), model_id.encode())
        if self.encoding == "ascii":  # NaN, Infinity as Python's json writes (and reads) them
            return json.dumps(self.body).encode()
        text = json.dumps(self.body, ensure_ascii=False)
        if self.encoding == "utf-16":
            return text.encode("utf-16", "surrogatepass")
        raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate: invalid UTF-8
        return b"\xef\xbb\xbf" + raw if self.encoding == "bom" else raw


# ---- values ---------------------------------------------------------------------------------

MISSING = object()  # the field is left out

# unicode; a third of them with lone surrogates (json.dumps writes them as \udXXX escapes)
any_text = st.one_of(st.text(max_size=24), st.text(max_size=24), st.lists(
    st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=24).map("".join))
short_text = st.text(alphabet="abc xyz\n\t{}():é世🙂", min_size=1, max_size=12)  # fast prompts
huge_ints = st.sampled_from([2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64,
                             -(2**64), 10**30, -(10**30)])
odd_floats = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-46, 1e-6, 1e-5, 0.5, 1.0, 1.0000001, 2.0,
                              3.4e38, 3.5e38, 1e300, -1.0, -1e300, math.inf, -math.inf, math.nan])
nan_like = st.sampled_from(["NaN", "nan", "-nan", "Infinity", "-Infinity", "inf", "1e999", "-0", "0x10",
                            "1_000", " 1 ", "", "null", "true", "3"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), huge_ints,
                    st.floats(allow_nan=True, allow_infinity=True), odd_floats, any_text, nan_like)
garbage = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(any_text, inner, max_size=4)),
                       max_leaves=10)


def mostly(usual: st.SearchStrategy, odd: st.SearchStrategy, usual_percent: int = 85) -> st.SearchStrategy:
    """`usual` usual_percent % of the time, else `odd`."""
    return st.integers(0, 99).flatmap(lambda n: usual if n < usual_percent else odd)


@dataclasses.dataclass(frozen=True)
class Field:
    """A body field: how often a body sets it (%), its usual values (None: none, only odd ones)
    and its odd values (garbage too, always)."""

    percent: int
    usual: st.SearchStrategy | None
    odd: st.SearchStrategy | None = None

    def odd_values(self) -> st.SearchStrategy:
        return garbage if self.odd is None else st.one_of(self.odd, garbage)


short_ints = st.sampled_from([0, -1, 5, LIMIT, LIMIT + 1, 4096, 10**6, 1.0, 2.5, True])
max_tokens = Field(85, st.integers(1, 4), st.one_of(short_ints, huge_ints, nan_like))
roles = st.sampled_from(["system", "user", "assistant"])
odd_roles = st.one_of(st.sampled_from(["tool", "developer", "function", "", "USER"]), any_text)
parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": short_text}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "TEXT", ""]),
                           "text": st.one_of(short_text, garbage)}),
    st.dictionaries(any_text, garbage, max_size=3)), max_size=3)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": short_text}), min_size=1, max_size=2)


tame_messages = st.lists(st.fixed_dictionaries({"role": roles, "content": st.one_of(short_text, text_parts)}),
                         min_size=1, max_size=3)
odd_message = st.fixed_dictionaries(
    {"role": mostly(roles, st.one_of(odd_roles, garbage), 70),
     "content": mostly(short_text, st.one_of(st.none(), any_text, parts, st.just(""), garbage), 50)},
    optional={"name": st.one_of(any_text, garbage), "tool_calls": garbage})
wild_messages = st.one_of(st.lists(odd_message, min_size=1, max_size=3), st.just([]), st.lists(garbage, max_size=3),
                          st.lists(st.fixed_dictionaries({"content": short_text}), min_size=1, max_size=2), garbage)


odd_logprobs = st.sampled_from([None, False, True, 0, 1, 2, 5, 6, 20, 21, -1, 2**31, "yes", "1", 1.5, 2.0])
top_logprobs = Field(20, st.integers(0, 20), st.sampled_from([None, 21, -1, 2**40, "x", True, 1.5]))

COMMON = {
    "max_tokens": max_tokens,
    "temperature": Field(50, st.one_of(st.sampled_from([0, 0.0, 0.7, 1, 1.5]), st.floats(0, 2)),
                         st.one_of(odd_floats, huge_ints, nan_like, st.floats())),
    "top_p": Field(25, st.floats(0.05, 1), st.one_of(odd_floats, huge_ints, nan_like, st.floats())),
    "top_k": Field(25, st.integers(0, 50), st.one_of(huge_ints, st.integers(-5, -1), nan_like, st.just(1.5))),
    "seed": Field(25, st.integers(0, 2**64 - 1), st.one_of(st.sampled_from([-1, 2**64, 2**100, 1.5, 1.0]), nan_like)),
    "stream": Field(40, st.booleans(), st.sampled_from(["true", "false", 1, 0, "yes", None, []])),
    "stream_options": Field(15, st.fixed_dictionaries({"include_usage": st.booleans()}), st.none()),
    "stop": Field(25, st.one_of(short_text, st.lists(short_text, max_size=4)), st.one_of(
        st.lists(any_text, min_size=15, max_size=20), st.lists(any_text, max_size=3),
        st.lists(garbage, max_size=3), st.sampled_from(["", [""], ["", ""], "\n", [" "]]), any_text)),
    "n": Field(8, st.just(1), st.sampled_from([0, 2, -1, 10**9])),
    "logit_bias": Field(5, st.just({}), st.just({"5": 1.0})),
    "presence_penalty": Field(5, st.just(0), odd_floats),
    "frequency_penalty": Field(5, st.just(0.0), odd_floats),
    "user": Field(8, short_text, any_text),
    "ignore_eos": Field(30, st.booleans(), st.sampled_from(["true", 2, None])),
    "num_speculative_tokens": Field(25, st.integers(0, 4), st.sampled_from([-1, 16, 17, 2**31, 2**64])),
    "proposer": Field(25, st.sampled_from(["auto", "draft", "ngram", "none"]),
                      st.sampled_from(["bogus", "", "AUTO", 1, None])),
    "cache_salt": Field(8, st.sampled_from(["", "salt"]), st.one_of(st.just("x" * 257), any_text)),
}
completion_only = {
    "prompt": Field(95, st.one_of(short_text, st.lists(st.integers(0, 255), min_size=1, max_size=8),
                                  st.lists(short_text, min_size=1, max_size=1),
                                  st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=8),
                                           min_size=1, max_size=1)),
                    st.one_of(any_text, st.lists(st.one_of(huge_ints, st.integers(-5, 400)), max_size=5),
                              st.lists(any_text, min_size=1, max_size=3), st.sampled_from(["", [], [[]]]),
                              st.lists(st.lists(st.integers(0, 255), max_size=3), min_size=2, max_size=3))),
    "logprobs": Field(30, st.integers(0, 5), odd_logprobs),  # alternatives per token
    "top_logprobs": Field(5, None, top_logprobs.usual),  # chat's field: unknown here
    "echo": Field(5, st.just(False), st.booleans()),
    "suffix": Field(5, st.none(), st.one_of(st.just(""), any_text)),
    "best_of": Field(5, st.just(1), st.sampled_from([2, 0, -1])),
}
chat_only = {
    "max_completion_tokens": dataclasses.replace(max_tokens, percent=20),
    "logprobs": Field(30, st.booleans(), odd_logprobs),
    "top_logprobs": top_logprobs,  # refused without logprobs: true
    "tools": Field(5, st.just([]), st.just([{"type": "function", "function": {"name": "f"}}])),
    "response_format": Field(8, st.just({"type": "text"}), st.sampled_from([{"type": "json_object"}, {}])),
}
KNOWN = set(COMMON) | set(completion_only) | set(chat_only) | {"model", "messages", "session_id"}


@st.composite
def bodies(draw, path: str, model_id: str, sessions: list[str]) -> dict[str, Any]:
    """A JSON object for `path`: a tame one (every value one the round loop takes, so the fuzz
    reaches generation), or one with one to three fields odd (odd values, garbage, or left out
    when required) and the others tame, so that the odd value is what the server judges."""
    fields = {**COMMON, **(completion_only if path == COMPLETIONS else chat_only)}
    odd = set() if draw(st.integers(0, 99)) < 40 else draw(
        st.sets(st.sampled_from(sorted([*fields, "model", "session_id"] + (["messages"] if path == CHAT else []))),
                min_size=1, max_size=3))
    body: dict[str, Any] = {}
    model = draw(st.one_of(st.sampled_from(["", model_id.upper(), model_id + " ", "gpt-4", MISSING]), garbage)
                 if "model" in odd else st.just(model_id))
    if model is not MISSING:
        body["model"] = model
    if path == CHAT:
        if "messages" in odd:
            body["messages"] = draw(st.one_of(wild_messages, st.just(MISSING)))
        else:
            body["messages"] = draw(tame_messages)
    for name, field in fields.items():
        if name in odd:  # the prompt is required: left out, too
            body[name] = draw(st.one_of(field.odd_values(), st.just(MISSING)) if name == "prompt"
                              else field.odd_values())
        elif field.usual is not None and draw(st.integers(0, 99)) < field.percent:
            body[name] = draw(field.usual)
    if path == CHAT and "top_logprobs" in body and not odd & {"top_logprobs", "logprobs"}:
        body["logprobs"] = True  # what top_logprobs needs
    if "session_id" in odd:  # unknown, odd
        body["session_id"] = draw(st.one_of(st.sampled_from(["", "no-such-session"]), any_text, garbage))
    elif draw(st.integers(0, 99)) < 15:  # continue one of the fuzz's sessions
        body["session_id"] = draw(st.sampled_from(sessions))
    if draw(st.integers(0, 99)) < 15:  # unknown fields: ignored
        body.update(draw(st.dictionaries(any_text.filter(lambda k: k not in KNOWN), garbage, min_size=1,
                                         max_size=3)))
    return {name: value for name, value in body.items() if value is not MISSING}


NAN_TEMPERATURE = b'{"model": "{model}", "prompt": "hi", "temperature": NaN, "max_tokens": 2}'
LONG_NUMBER = b'{"model": "{model}", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"  # past int()'s digits
RAW = [b"", b" ", b"null", b"[]", b"[{}]", b'"a string"', b"42", b"-1e999", b"true", b"NaN", b"{", b"}", b"{}",
       b'{"model": ', b"\xff\xfe\x00", b"\x00" * 10, b"model=x&prompt=y", b'{"model": "{model}", "prompt": "hi"',
       b'{"model": "{model}", "prompt": "hi", "max_tokens": 1, "max_tokens": 2}',  # a duplicate key: the last
       b'{"model": "{model}", "prompt": "hi", "max_tokens": 1} trailing',
       b'{"model": "{model}", "prompt": "hi", "max_tokens": 1e999}',
       NAN_TEMPERATURE, LONG_NUMBER,
       b'{"model": "{model}", "prompt": "hi", "top_p": -Infinity, "max_tokens": 2}',
       b'{"model": "{model}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
       b'{"model": "{model}", "prompt": ' + b"[" * 100 + b"1" + b"]" * 100 + b', "max_tokens": 2}']


@st.composite
def calls(draw, model_id: str, sessions: list[str]) -> Call:
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    content_type = draw(mostly(st.sampled_from(["application/json", "application/json; charset=utf-8"]),
                               st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                                "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                                "image/png"])))
    method = draw(mostly(st.just("POST"), st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]), 96))
    kind = draw(st.integers(0, 99))
    if kind < 88:  # a JSON object, mostly a request the round loop runs
        encoding = draw(mostly(st.just("ascii"), st.sampled_from(["utf-8", "utf-16", "bom"]), 90))
        return Call(path, draw(bodies(path, model_id, sessions)), encoding=encoding, content_type=content_type,
                    method=method)
    if kind < 94:
        return Call(path, content=draw(st.sampled_from(RAW)), content_type=content_type, method=method)
    if kind < 97:  # JSON that is no object: a list of bodies, a garbage value
        value = draw(st.one_of(st.lists(bodies(path, model_id, sessions), max_size=2), garbage))
        return Call(path, content=json.dumps(value).encode(), content_type=content_type, method=method)
    return Call(path, content=draw(st.binary(max_size=64)), content_type=content_type, method=method)


# ---- the checks ------------------------------------------------------------------------------

def settle(response: httpx.Response) -> httpx.Response:
    """After a 5xx the in-process coordinator logs the exception. Python 3.11's traceback module
    parses source lines with `ast` to draw its carets, and `ast` is not thread-safe: pytest's own
    ast.parse of a failure's report at the same moment dies with "SystemError: AST constructor
    recursion depth mismatch" (an INTERNALERROR). Let the log be written first."""
    if response.status_code >= 500:
        time.sleep(0.2)
    return response


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} in an answer: not JSON (RFC 8259), which clients other than Python's reject")


def strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def check_error(response: httpx.Response) -> dict:
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    data = strict_json(response.text)
    assert isinstance(data, dict) and set(data) == {"error"}, data
    error = data["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _logprobs_asked(call: Call) -> bool | None:
    """Whether the request asked for log-probabilities (None: a value whose meaning is not checked)."""
    value = (call.body or {}).get("logprobs")
    if call.path == CHAT:
        return value is True if value is None or type(value) is bool else None
    return value is not None if value is None or type(value) is int else None


def check_json(call: Call, response: httpx.Response, model_id: str) -> None:
    data = strict_json(response.text)
    chat = call.path == CHAT
    assert data["object"] == ("chat.completion" if chat else "text_completion"), data
    assert data["model"] == model_id
    [choice] = data["choices"]
    assert choice["finish_reason"] in ("stop", "length"), choice
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str)
    if chat:
        assert choice["message"]["role"] == "assistant"
    asked = _logprobs_asked(call)
    if asked is not None:
        assert (choice["logprobs"] is not None) == asked, (choice, call.body)
    usage = data["usage"]
    assert 0 <= usage["completion_tokens"] <= LIMIT and usage["prompt_tokens"] >= 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    body = call.body or {}
    # chat: max_completion_tokens wins over max_tokens when set (only plain ints are checked)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    limit = _int_field(body, name)
    if limit is not None:
        assert usage["completion_tokens"] <= limit, (usage, body)
    assert isinstance(data["specdec"]["session_id"], str) and data["specdec"]["session_id"]


def check_stream(call: Call, response: httpx.Response) -> None:
    raw = response.text
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events), raw[:500]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    payloads = [strict_json(event[len("data: "):]) for event in events[:-1]]
    errors = [p for p in payloads if "error" in p]
    for error in errors:  # shaped as a refusal's body; healthy services never fail a stream
        assert set(error) == {"error"} and error["error"]["message"], error
    assert not errors, (errors, call)
    kind = "chat.completion.chunk" if call.path == CHAT else "text_completion"
    assert payloads and all(p["object"] == kind for p in payloads), payloads
    finishes = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"] is not None]
    assert finishes and finishes[-1] in ("stop", "length"), payloads
    assert len({p["specdec"]["session_id"] for p in payloads}) == 1


@pytest.fixture(scope="module")
def http_cluster(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], dtype="float32",
                 coordinator={"http_port": -1, "max_new_tokens_limit": LIMIT, "default_max_new_tokens": 4}) as cluster:
        yield cluster


def test_fuzz_openai_bodies(http_cluster, base_url, model_id):
    http = httpx.Client(base_url=base_url, timeout=60)
    sessions = []
    for prompt in ("one", "two", "three"):  # sessions the fuzz continues
        seeded = http.post(COMPLETIONS, json={"model": model_id, "prompt": prompt, "max_tokens": 2})
        assert seeded.status_code == 200, seeded.text
        sessions.append(seeded.json()["specdec"]["session_id"])
    seen: dict[tuple[str, int], int] = {}
    streamed = []

    def answer(call: Call) -> httpx.Response:
        headers = {"content-type": call.content_type} if call.content_type else {}
        return settle(http.request(call.method, call.path, content=call.payload(model_id), headers=headers))

    valid = {"prompt": "def f(x):", "max_tokens": 3, "model": MODEL}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @example(Call(COMPLETIONS, content=b""))
    @example(Call(CHAT, content=b"", content_type=None))
    @example(Call(COMPLETIONS, content=b"[" * 5000))  # was a 500: RecursionError
    @example(Call(COMPLETIONS, content=LONG_NUMBER))
    @example(Call(COMPLETIONS, content=NAN_TEMPERATURE))
    @example(Call(COMPLETIONS, body={**valid, "stream": True, "stop": [""]}))
    @example(Call(COMPLETIONS, body={**valid, "stream": True, "stream_options": {"include_usage": True}}))
    @example(Call(COMPLETIONS, body={**valid, "temperature": 1e300}))  # past float32: the target refuses
    @example(Call(COMPLETIONS, body={**valid, "top_p": 1e-300, "temperature": 1}))  # 0.0 as float32
    @example(Call(COMPLETIONS, body={**valid, "seed": 2**64 - 1, "temperature": 1, "top_k": 2**31 - 1}))
    @example(Call(COMPLETIONS, body={**valid, "max_tokens": 10**30}))
    @example(Call(COMPLETIONS, body={**valid, "prompt": [True, False]}))
    @example(Call(COMPLETIONS, body={**valid, "logprobs": 2, "echo": False}))
    @example(Call(CHAT, body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "logprobs": True, "top_logprobs": 2}))
    @example(Call(CHAT, body={"model": MODEL, "messages": [{"role": "tool", "content": None}], "max_tokens": 2,
                              "stream": True}))
    @example(Call(COMPLETIONS, body=valid, content_type="text/plain", encoding="utf-16"))
    @example(Call(COMPLETIONS, body=valid, method="GET"))
    @example(Call(COMPLETIONS, body={**valid, "model": "gpt-4"}))
    @example(Call(CHAT, body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "session_id": "no-such-session", "stream": True}))
    @given(calls(model_id, sessions))
    def check(call):
        if call.body is not None and call.body.get("model") == MODEL:
            call = dataclasses.replace(call, body={**call.body, "model": model_id})
        response = answer(call)
        status = response.status_code
        assert 200 <= status < 300 or 400 <= status < 500, (status, response.text[:500], call)
        seen[call.path, status] = seen.get((call.path, status), 0) + 1
        if status >= 400:
            check_error(response)
            if status == 405:
                assert call.method != "POST"
            return
        assert call.method == "POST"
        streaming = response.headers["content-type"].startswith("text/event-stream")
        if call.body is not None and type(call.body.get("stream", False)) is bool:
            assert streaming == call.body.get("stream", False), (response.headers, call)
        if streaming:
            check_stream(call, response)
            streamed.append(call.path)
        else:
            check_json(call, response, model_id)

    try:
        check()
    finally:
        http.close()
    summary = sorted(seen.items())
    print("answers (path, status): count:", summary)
    ok = {path for (path, status) in seen if status == 200}
    assert ok == {COMPLETIONS, CHAT}, summary  # the fuzz reached the round loop through both endpoints
    statuses = {status for (_, status) in seen}
    assert {200, 400, 404, 405} <= statuses, summary
    assert set(streamed) == {COMPLETIONS, CHAT}, summary
    assert sum(n for (_, status), n in seen.items() if status == 200) >= 30, summary  # the deeper fields

    # the servers are up and serve as before, with nothing left running
    deadline = time.monotonic() + 10
    while http_cluster.coordinator.round_loop.active:
        assert time.monotonic() < deadline, "a fuzzed request is still counted as generating"
        time.sleep(0.05)
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    for port in (http_cluster.draft_port, http_cluster.target_port, http_cluster.coordinator.port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    reply = httpx.post(f"{base_url}{COMPLETIONS}", timeout=60, json={
        "model": model_id, "prompt": "still up", "max_tokens": 4, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


# Each of these was a 500 ("internal error in the coordinator") when the fuzz found it: a client's
# bad input must be a 4xx with OpenAI's error JSON, naming what is wrong.
FOUND = [
    pytest.param(COMPLETIONS, b"[" * 5000, "nests JSON", id="deep-nesting"),
    pytest.param(COMPLETIONS, {"top_k": 2**31}, "top_k must be in [0, 2147483647]", id="top_k-past-int32"),
    pytest.param(COMPLETIONS, {"top_k": 2**70}, "top_k must be in", id="top_k-huge"),
    pytest.param(COMPLETIONS, {"temperature": 1e300}, "that a float32 holds", id="temperature-past-float32"),
    pytest.param(COMPLETIONS, {"top_p": 1e-300}, "a float32 holds nothing smaller", id="top_p-below-float32"),
    pytest.param(COMPLETIONS, {"prompt": "a\ud800b"}, "lone UTF-16 surrogate", id="surrogate-prompt"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "\udc80"}]}, "lone UTF-16 surrogate",
                 id="surrogate-chat-content"),
    pytest.param(CHAT, {"messages": [{"role": "\ud800", "content": "hi"}]}, "lone UTF-16 surrogate",
                 id="surrogate-chat-role"),
    pytest.param(COMPLETIONS, {"cache_salt": "\ud800"}, "lone UTF-16 surrogate", id="surrogate-cache_salt"),
]


@pytest.mark.parametrize("path, fields, message", FOUND)
def test_found_by_the_fuzz(base_url, model_id, path, fields, message):
    if isinstance(fields, bytes):
        content = fields
    else:
        base = ({"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]})
        content = json.dumps({"model": model_id, "max_tokens": 2, **base, **fields}).encode()
    response = settle(httpx.post(f"{base_url}{path}", content=content,
                                 headers={"content-type": "application/json"}, timeout=60))
    if not 400 <= response.status_code < 500:  # no traceback: see settle()
        pytest.fail(f"{response.status_code}: {response.text}", pytrace=False)
    assert message in check_error(response)["message"]
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
