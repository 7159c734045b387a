"""Failures of the model tiers through the OpenAI-compatible HTTP API, with the real services:
a target tier that is down is a 503 with OpenAI's error JSON, before any byte of the answer;
a target that goes away once a stream has begun ends the stream with an error event and
`data: [DONE]`, and the tokens committed before it stay in the session."""

from __future__ import annotations

import json
import time

try:  # the HTTP client the openai package brings: httpx, or its renamed fork in newer releases
    import httpx2 as httpx
except ImportError:
    import httpx

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster

PROMPT = "def fibonacci(n):"
# greedy, always the draft model, never an early end: a long and reproducible generation
GREEDY = {"temperature": 0, "ignore_eos": True, "num_speculative_tokens": 2, "proposer": "draft"}
RETRY_S = 0.5  # the coordinator's --target-retry-s here: an unreachable target fails fast


def _error(body: dict) -> dict:
    """OpenAI's error object of `body`, its shape checked."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def _unavailable(response: httpx.Response, address: str) -> dict:
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = _error(response.json())
    assert error["type"] == "service_unavailable" and error["code"] == "unavailable", error
    # actionable: it names the tier and the replica that failed
    assert "target" in error["message"] and address in error["message"], error["message"]
    return error


def _session_tokens(cluster: Cluster, session_id: str) -> list[int]:
    request = coordinator_pb2.GetSessionRequest(session_id=session_id)
    return list(cluster.stub.GetSession(request, timeout=30).token_ids)


def test_target_down_is_503_then_recovers(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 coordinator={"http_port": -1, "target_retry_s": RETRY_S}) as cluster:
        base = f"http://127.0.0.1:{cluster.coordinator.http_port}"
        model_id = cluster.coordinator.served_model_names[0]
        address = f"127.0.0.1:{cluster.target_port}"
        completion = {"model": model_id, "prompt": PROMPT, "max_tokens": 3, **GREEDY}
        chat = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **GREEDY}
        with httpx.Client(base_url=base, timeout=60) as http:
            first = http.post("/v1/completions", json=completion)
            assert first.status_code == 200, first.text  # up: it answers
            session_id = first.json()["specdec"]["session_id"]
            held = _session_tokens(cluster, session_id)

            cluster.target.stop(None).wait()
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                for stream in (False, True):  # a stream is refused before it starts: its own status
                    started = time.monotonic()
                    response = http.post(path, json={**body, "stream": stream})
                    _unavailable(response, address)
                    # the retry budget (--target-retry-s), not the client's timeout, ended the wait
                    assert time.monotonic() - started < 20, "the coordinator waited far past its retry budget"
            # a continued session fails the same way, and keeps what it held
            _unavailable(http.post("/v1/completions", json={**completion, "session_id": session_id}), address)
            assert _session_tokens(cluster, session_id)[: len(held)] == held
            assert http.get("/health").status_code == 200
            assert cluster.coordinator.round_loop.active == 0  # no generation left counted

            cluster.restart_target()  # the same address: the coordinator finds it again
            deadline = time.monotonic() + 30
            while True:
                response = http.post("/v1/completions", json=completion)
                if response.status_code == 200:
                    break
                _unavailable(response, address)  # only the same 503 while the target is being found again
                assert time.monotonic() < deadline, "the coordinator never used the restarted target"
                time.sleep(0.2)
            assert response.json()["usage"]["completion_tokens"] == 3
            again = http.post("/v1/completions", json={**completion, "session_id": session_id})
            assert again.status_code == 200, again.text
            assert _session_tokens(cluster, session_id)[: len(held)] == held


def _sse_events(response: httpx.Response, after_first=None) -> list[str]:
    """The data of every server-sent event of `response`, in order; after_first() runs once the
    first event with choices is in."""
    events, called = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data)
        if not called and after_first is not None and data != "[DONE]" and json.loads(data).get("choices"):
            called = True
            after_first()
    return events


def test_target_failing_mid_stream_ends_with_an_error_event(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"],
                 coordinator={"http_port": -1, "target_retry_s": RETRY_S}) as cluster:
        base = f"http://127.0.0.1:{cluster.coordinator.http_port}"
        model_id = cluster.coordinator.served_model_names[0]
        tokenizer = cluster.coordinator.round_loop.tokenizer
        # what the interrupted generation would have produced (greedy: the same tokens)
        reference = cluster.complete(prompt=PROMPT, max_new_tokens=40, ignore_eos=True, temperature=0.0,
                                     num_speculative_tokens=2, proposer=coordinator_pb2.PROPOSER_DRAFT)
        prompt_ids = _session_tokens(cluster, reference.session_id)[: reference.stats.prompt_tokens]
        assert prompt_ids

        # far longer than the time it takes to stop the target (it ends at the context at most)
        body = {"model": model_id, "prompt": PROMPT, "max_tokens": 2000, "stream": True, **GREEDY}
        stopped = []

        def stop_target():
            cluster.target.stop(None).wait()
            stopped.append(time.monotonic())

        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200  # the stream had begun: the status was sent
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(response, after_first=stop_target)
        assert stopped, "no chunk with choices came before the end of the stream"

        assert events and events[-1] == "[DONE]", events[-3:]
        assert events.count("[DONE]") == 1
        payloads = [json.loads(data) for data in events[:-1]]
        errors = [p for p in payloads if "error" in p]
        assert len(errors) == 1 and payloads[-1] is errors[0], \
            "the failure must be one error event, the last before [DONE]"
        error = _error(errors[0])
        assert error["type"] == "service_unavailable" and error["code"] == "unavailable", error
        assert "target" in error["message"] and f"127.0.0.1:{cluster.target_port}" in error["message"], error

        chunks = payloads[:-1]
        assert chunks and all(c["object"] == "text_completion" for c in chunks)
        assert all(choice["finish_reason"] is None for c in chunks for choice in c["choices"]), \
            "the generation finished before the target was stopped: nothing failed mid-stream"
        [session_id] = {c["specdec"]["session_id"] for c in chunks}
        streamed = "".join(choice["text"] for c in chunks for choice in c["choices"])
        assert streamed

        # every token streamed was committed first: the session holds the prompt and them
        stored = _session_tokens(cluster, session_id)
        assert stored[: len(prompt_ids)] == prompt_ids
        generated = stored[len(prompt_ids):]
        assert generated, "the session lost the tokens streamed before the error"
        assert tokenizer.decode(generated).startswith(streamed), (tokenizer.decode(generated), streamed)
        common = min(len(generated), len(reference.token_ids))
        assert generated[:common] == list(reference.token_ids)[:common]  # the right tokens, too
        # the round loop's store says the same
        record = cluster.loop.run(cluster.coordinator.round_loop.store.get(session_id))
        assert list(record.token_ids) == stored
        assert cluster.coordinator.round_loop.active == 0

        # the session is free and continues from what was committed once the target is back
        cluster.restart_target()
        deadline = time.monotonic() + 30
        more = {"model": model_id, "prompt": " more", "max_tokens": 3, "session_id": session_id, **GREEDY}
        while True:
            response = httpx.post(f"{base}/v1/completions", json=more, timeout=60)
            if response.status_code == 200:
                break
            assert response.status_code == 503, (response.status_code, response.text)
            assert time.monotonic() < deadline, "the coordinator never used the restarted target"
            time.sleep(0.2)
        assert response.json()["specdec"]["session_id"] == session_id
        after = _session_tokens(cluster, session_id)
        assert after[: len(stored)] == stored and len(after) > len(stored)
