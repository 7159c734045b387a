"""The OpenAI-compatible HTTP API (coordinator/api/openai_api.py) through the official openai client
and raw HTTP, against the real services: it generates what the gRPC API generates."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import threading
import time

import openai
import pytest

try:  # the HTTP client the openai package brings: httpx, or its renamed fork in newer releases
    import httpx2 as httpx
except ImportError:
    import httpx

from coordinator.api.openai_protocol import TokenText
from tests.cluster import Cluster

PROMPT = "def fibonacci(n):"
GREEDY = {"temperature": 0}
EXTRA = {"ignore_eos": True, "num_speculative_tokens": 2, "proposer": "draft"}


@pytest.fixture(scope="module")
def http_cluster(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], coordinator={"http_port": -1}) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def grpc_greedy(cluster, max_new_tokens: int, **input_fields):
    return cluster.complete(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0,
                            num_speculative_tokens=2, **input_fields)


def test_health_and_models(base_url, client, http_cluster, model_id):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    listing = httpx.get(f"{base_url}/v1/models").json()
    assert listing["object"] == "list"
    [entry] = listing["data"]
    assert entry["id"] == model_id and entry["object"] == "model" and entry["owned_by"] == "specdec"
    assert entry["max_model_len"] == http_cluster.coordinator.round_loop.context_length
    assert isinstance(entry["created"], int)
    assert [m.id for m in client.models.list()] == [model_id]


def test_completion_greedy_matches_grpc(http_cluster, client, model_id):
    expected = grpc_greedy(http_cluster, 12, prompt=PROMPT)
    reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, extra_body=EXTRA, **GREEDY)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    [choice] = reply.choices
    assert choice.text == expected.text and choice.finish_reason == "length" and choice.index == 0
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == expected.stats.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    specdec = reply.model_extra["specdec"]
    assert specdec["session_id"] and specdec["rounds"] == expected.stats.rounds
    # token ids as the prompt, and a one-element batch
    ids = list(http_cluster.coordinator.round_loop.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    by_ids = grpc_greedy(http_cluster, 6, token_ids=ids)
    assert client.completions.create(model=model_id, prompt=ids, max_tokens=6, extra_body=EXTRA,
                                     **GREEDY).choices[0].text == by_ids.text
    assert client.completions.create(model=model_id, prompt=[PROMPT], max_tokens=12, extra_body=EXTRA,
                                     **GREEDY).choices[0].text == expected.text
    # streamed: the deltas add up to the same text
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, stream=True,
                                            extra_body=EXTRA, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)
    assert {c.model_extra["specdec"]["session_id"] for c in chunks} and all(
        c.model_extra["specdec"]["session_id"] for c in chunks)


def test_chat_greedy_matches_grpc(http_cluster, client, base_url, model_id):
    messages = [("system", "Be brief."), ("user", "Explain quicksort.")]
    expected = grpc_greedy(http_cluster, 10, messages=messages)
    as_dicts = [{"role": r, "content": c} for r, c in messages]
    reply = client.chat.completions.create(model=model_id, messages=as_dicts, max_completion_tokens=10,
                                           extra_body=EXTRA, **GREEDY)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text and reply.choices[0].finish_reason == "length"
    # content as text parts, max_tokens, the async client, streamed
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             as_dicts[1]]

    async def streamed() -> list:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as aclient:
            whole = await aclient.chat.completions.create(model=model_id, messages=parts, max_tokens=10,
                                                          extra_body=EXTRA, **GREEDY)
            assert whole.choices[0].message.content == expected.text
            stream = await aclient.chat.completions.create(model=model_id, messages=parts, max_tokens=10,
                                                           stream=True, extra_body=EXTRA, **GREEDY)
            return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_logprobs_match_grpc(http_cluster, client, base_url, model_id):
    """The target's log-probabilities, as the gRPC API returns them, in OpenAI's two shapes."""
    expected = grpc_greedy(http_cluster, 8, prompt=PROMPT, top_logprobs=3)
    decode = TokenText(http_cluster.coordinator.round_loop.tokenizer)  # a token's name: its text, or its bytes
    names = [decode(entry.token_id) for entry in expected.logprobs]
    reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, logprobs=3,
                                      extra_body=EXTRA, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == names
    assert logprobs.token_logprobs == pytest.approx([entry.logprob for entry in expected.logprobs])
    assert logprobs.top_logprobs == [
        {decode(t): pytest.approx(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        for entry in expected.logprobs]
    assert all(len(top) == 3 for top in logprobs.top_logprobs)  # every alternative has its own name
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # chat, streamed through the async client: each chunk's tokens with their alternatives
    messages = [{"role": "user", "content": "Explain quicksort."}]
    chat_expected = grpc_greedy(http_cluster, 8, messages=[("user", "Explain quicksort.")], top_logprobs=2)

    async def streamed() -> list:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as aclient:
            stream = await aclient.chat.completions.create(model=model_id, messages=messages, max_tokens=8,
                                                           logprobs=True, top_logprobs=2, stream=True,
                                                           extra_body=EXTRA, **GREEDY)
            return [chunk async for chunk in stream]

    content = [entry for chunk in asyncio.run(streamed()) if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert [entry.token for entry in content] == [decode(e.token_id) for e in chat_expected.logprobs]
    assert [entry.logprob for entry in content] == pytest.approx([e.logprob for e in chat_expected.logprobs])
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert [bytes(entry.bytes) for entry in content] == [decode.named(e.token_id)[1] for e in chat_expected.logprobs]
    assert [[top.token for top in entry.top_logprobs] for entry in content] == [
        [decode(t) for t in e.top_token_ids] for e in chat_expected.logprobs]
    # not asked: null; logprobs without top_logprobs: no alternatives
    plain = client.chat.completions.create(model=model_id, messages=messages, max_tokens=3, extra_body=EXTRA,
                                           **GREEDY)
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(model=model_id, messages=messages, max_tokens=3, logprobs=True,
                                          extra_body=EXTRA, **GREEDY)
    assert len(only.choices[0].logprobs.content) == 3
    assert all(entry.top_logprobs == [] for entry in only.choices[0].logprobs.content)


def test_stream_usage_and_sse_framing(client, base_url, model_id):
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, extra_body=EXTRA, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert chunks[-1].model_extra["specdec"]["rounds"] >= 1
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY, **EXTRA}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    payloads = [json.loads(event[len("data: "):]) for event in events[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_errors(client, base_url, model_id):
    url = f"{base_url}/v1/completions"
    base = {"model": model_id, "prompt": PROMPT, "max_tokens": 2}
    error = _error(httpx.post(url, json={**base, "model": "no-such-model"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert _error(httpx.post(url, json={**base, "n": 2}), 400)["param"] == "n"
    assert _error(httpx.post(url, json={**base, "logit_bias": {"1": 2.0}}), 400)["param"] == "logit_bias"
    assert _error(httpx.post(url, json={**base, "logprobs": 6}), 400)["param"] == "logprobs"
    chat = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert "needs logprobs" in _error(httpx.post(f"{base_url}/v1/chat/completions",
                                                 json={**chat, "top_logprobs": 2}), 400)["message"]
    assert _error(httpx.post(f"{base_url}/v1/chat/completions",
                             json={**chat, "logprobs": True, "top_logprobs": 21}), 400)["param"] == "top_logprobs"
    assert "temperature" in _error(httpx.post(url, json={**base, "temperature": -1}), 400)["message"]
    assert _error(httpx.post(url, content=b'{"model": ', headers={"content-type": "application/json"}), 400)
    assert _error(httpx.post(url, json={**base, "max_tokens": "many"}), 400)["param"] == "max_tokens"
    assert _error(httpx.post(url, json={**base, "prompt": ["a", "b"]}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={k: v for k, v in base.items() if k != "prompt"}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, content=b"x" * (2 << 20)), 413)
    # errors name the HTTP field the request sent, in the message and in param
    error = _error(httpx.post(url, json={**base, "max_tokens": 0}), 400)
    assert error["param"] == "max_tokens" and error["message"].startswith("max_tokens must be in [1, "), error
    assert "max_new_tokens" not in error["message"]
    error = _error(httpx.post(url, json={**base, "max_tokens": "4"}), 400)  # OpenAI's API does not coerce
    assert error["param"] == "max_tokens" and '"4"' in error["message"], error
    assert _error(httpx.post(url, json={**base, "temperature": "0.5"}), 400)["param"] == "temperature"
    error = _error(httpx.post(url, json={**base, "prompt": ""}), 400)
    assert error["param"] == "prompt" and error["message"] == "prompt is empty: give some text", error
    error = _error(httpx.post(url, json={**base, "prompt": []}), 400)
    assert error["param"] == "prompt" and error["message"].startswith("prompt is empty"), error
    chat_url = f"{base_url}/v1/chat/completions"
    error = _error(httpx.post(chat_url, json={**chat, "messages": []}), 400)
    assert error["param"] == "messages" and error["message"].startswith("messages is empty"), error
    error = _error(httpx.post(chat_url, json={**chat, "max_completion_tokens": 0}), 400)
    assert error["param"] == "max_completion_tokens" and "max_completion_tokens must be" in error["message"]
    error = _error(httpx.post(url, json={**base, "top_k": -1}), 400)
    assert error["param"] == "top_k" and "top_k must be" in error["message"], error
    assert _error(httpx.post(f"{base_url}/v1/chat/completions", json={
        "model": model_id, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400)
    # a field named as the request wrote it, without pydantic's union branches; each hint its own
    error = _error(httpx.post(url, json={**base, "prompt": 5}), 400)
    assert error["param"] == "prompt" and error["message"] == (
        "prompt: Input should be a valid string or a valid list, got 5"), error
    error = _error(httpx.post(chat_url, json={**chat, "messages": [{"role": "user", "content": 5}]}), 400)
    assert error["param"] == "messages" and error["message"].startswith("messages[0].content: "), error
    error = _error(httpx.post(url, json={**base, "presence_penalty": 0.5}), 400)
    assert error["message"] == "presence_penalty is not supported yet: leave it unset or 0", error
    error = _error(httpx.post(chat_url, json={**chat, "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    assert error["param"] == "messages" and error["message"] == (
        "unknown chat role 'wizard': a message's role is one of system, user, assistant, tool"), error
    assert _error(httpx.post(url, json={**base, "session_id": "no-such-session"}), 404)["code"] == "not_found"
    assert _error(httpx.post(url, json={**base, "session_id": "no-such-session", "stream": True}), 404)
    assert _error(httpx.get(f"{base_url}/v1/nothing-here"), 404)
    # an unknown field is ignored; the openai client raises the right classes
    assert httpx.post(url, json={**base, "frobnicate": 1}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, n=2)


def test_served_model_names(models, model_id):
    """By default the target's directory's base name (never a path); --served-model-name gives
    one or more names, each accepted, the one a request used echoed in its response."""
    assert model_id == os.path.basename(models["llama"]["target"]) and "/" not in model_id
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 coordinator={"http_port": -1, "served_model_name": "alpha,beta"}) as cluster:
        url = f"http://127.0.0.1:{cluster.coordinator.http_port}/v1"
        listed = httpx.get(f"{url}/models").json()["data"]
        assert [entry["id"] for entry in listed] == ["alpha", "beta"]
        for name in ("alpha", "beta"):
            reply = httpx.post(f"{url}/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2},
                               timeout=60)
            assert reply.status_code == 200 and reply.json()["model"] == name, reply.text
        error = _error(httpx.post(f"{url}/completions", json={"model": model_id, "prompt": PROMPT}), 404)
        assert error["code"] == "model_not_found" and "'alpha' or 'beta'" in error["message"], error


def test_api_key_over_tls(models, tmp_path):
    from tests.e2e.test_security import _ca, _leaf

    ca = _ca(tmp_path, "ca")
    cert = _leaf(tmp_path, "coordinator", ca, "IP:127.0.0.1,DNS:localhost")
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    trust = ssl.create_default_context(cafile=ca["pem"])
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 coordinator={"http_port": -1, "api_key_file": str(key_file), "tls_cert_file": cert["pem"],
                              "tls_key_file": cert["key"]}) as cluster, \
            httpx.Client(verify=trust, timeout=60) as http:
        base_url = f"https://127.0.0.1:{cluster.coordinator.http_port}"
        assert http.get(f"{base_url}/health").status_code == 200  # open without a key
        assert _error(http.get(f"{base_url}/v1/models"), 401)["code"] == "invalid_api_key"
        assert _error(http.get(f"{base_url}/v1/models", headers={"authorization": "Bearer nope"}), 401)
        wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0, http_client=http)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{base_url}/v1", api_key="s3cret-key", max_retries=0, http_client=http)
        model_id = cluster.coordinator.served_model_names[0]
        reply = right.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, extra_body=EXTRA)
        assert reply.usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_the_session(client, base_url, model_id):
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 2000, "stream": True, **GREEDY, **EXTRA}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                session_id = json.loads(line[len("data: "):])["specdec"]["session_id"]
                break
    started = time.monotonic()
    while True:  # the cancelled request lets go of its session within a round or two
        try:
            reply = client.completions.create(model=model_id, prompt=" more", max_tokens=2,
                                              extra_body={**EXTRA, "session_id": session_id}, **GREEDY)
            break
        except openai.ConflictError:
            assert time.monotonic() - started < 5, "the disconnected stream still holds its session"
            time.sleep(0.1)
    assert reply.model_extra["specdec"]["session_id"] == session_id
    assert reply.usage.completion_tokens == 2


def committed_tokens(cluster, session_id: str) -> list[int]:
    from specdec.v1 import coordinator_pb2

    return list(cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id)).token_ids)


def test_disconnect_before_a_whole_response_frees_the_session(http_cluster, client, base_url, model_id):
    """A non-streamed request whose client gives up is cancelled at once, its tokens kept."""
    first = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, extra_body=EXTRA, **GREEDY)
    session_id = first.model_extra["specdec"]["session_id"]
    held = len(committed_tokens(http_cluster, session_id))
    body = {"model": model_id, "prompt": " more", "max_tokens": 2000, "session_id": session_id,
            **GREEDY, **EXTRA}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 2000 tokens
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    started = time.monotonic()
    while http_cluster.coordinator.round_loop.active:  # the generation stops within a round or two
        assert time.monotonic() - started < 5, "the abandoned request is still generating"
        time.sleep(0.05)
    kept = committed_tokens(http_cluster, session_id)
    assert held < len(kept) < held + 2000  # what it committed before the client left is kept
    reply = client.completions.create(model=model_id, prompt=" again", max_tokens=2,
                                      extra_body={**EXTRA, "session_id": session_id}, **GREEDY)
    assert reply.usage.completion_tokens == 2  # not busy


@contextlib.contextmanager
def generating(cluster, url: str, model_id: str):
    """A request continuing a fresh session, running (its round waits behind a held target
    worker) while the block runs: yields (its session id, its request body)."""
    from tests.spies import held_worker

    first = httpx.post(url, json={"model": model_id, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    session_id = first.json()["specdec"]["session_id"]
    continued = {"model": model_id, "prompt": " more", "max_tokens": 4, "session_id": session_id,
                 "ignore_eos": True}  # exactly 4 tokens, whatever the tiny model emits
    replies = []
    running = threading.Thread(target=lambda: replies.append(httpx.post(url, json=continued, timeout=60)))
    with held_worker(cluster.target_servicer):
        running.start()
        deadline = time.monotonic() + 30
        while cluster.target_servicer.worker.queue_depth < 1:  # its round waits for the model
            assert time.monotonic() < deadline, "the running request never reached the target"
            time.sleep(0.01)
        yield session_id, continued
    running.join(60)
    assert replies and replies[0].status_code == 200  # the held request finished normally
    assert replies[0].json()["usage"]["completion_tokens"] == 4


def test_a_busy_session_is_409(http_cluster, base_url, model_id):
    """A second request on a session that is generating: the gRPC API's FAILED_PRECONDITION."""
    url = f"{base_url}/v1/completions"
    with generating(http_cluster, url, model_id) as (session_id, continued):
        error = _error(httpx.post(url, json=continued, timeout=60), 409)
        assert error["code"] == "conflict" and session_id in error["message"]  # the caller's own id


def test_a_full_coordinator_is_429_with_retry_after(models):
    """With --max-concurrent-generations 1 and one request generating, another is 429 with
    Retry-After: the gRPC API's RESOURCE_EXHAUSTED and its retry-after-ms trailer."""
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 coordinator={"http_port": -1, "max_concurrent_generations": 1}) as full_cluster:
        url = f"http://127.0.0.1:{full_cluster.coordinator.http_port}/v1/completions"
        model_id = full_cluster.coordinator.served_model_names[0]
        with generating(full_cluster, url, model_id):
            full = httpx.post(url, json={"model": model_id, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
            error = _error(full, 429)
            assert error["type"] == "rate_limit_error" and "max-concurrent-generations" in error["message"]
            assert full.headers["retry-after"] == "1" and full.headers["retry-after-ms"] == "1000"
