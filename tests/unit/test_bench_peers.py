"""The speed-up suite's peers: llama-server's streamed events timed as chunks, and each peer
family's best method compared with specdec's."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from bench import llama_server, report


class _Events(http.server.BaseHTTPRequestHandler):
    """POST /completion answered with llama-server-shaped server-sent events."""

    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        ids = list(range(100, 100 + body["n_predict"]))
        events = [{"content": "a", "tokens": ids[:1], "stop": False},
                  {"content": "bc", "tokens": ids[1:3], "stop": False},
                  {"content": "", "tokens": [], "stop": False},
                  {"content": "d", "tokens": ids[3:], "stop": False},
                  {"content": "", "stop": True, "timings": {"predicted_n": len(ids)}}]
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()

    def log_message(self, *_):
        pass


@pytest.fixture
def events_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Events)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_a_generation_is_timed_chunk_by_chunk(events_server):
    timed = llama_server.generate(events_server, [1, 2, 3], 6)
    assert timed.token_ids == [100, 101, 102, 103, 104, 105]
    assert [count for _, count in timed.chunks] == [1, 2, 3]  # the empty event is no chunk
    assert timed.ended >= timed.chunks[-1][0] >= timed.chunks[0][0] >= timed.started
    body = _Events.bodies[-1]
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 6
    assert body["ignore_eos"] and body["stream"] and body["temperature"] == 0.0 and not body["cache_prompt"]


def test_the_drafted_server_gets_the_draft_and_its_threads():
    plain = llama_server.command("llama-server", "t.gguf", 9000, 2)
    drafted = llama_server.command("llama-server", "t.gguf", 9001, 2, draft="d.gguf")
    assert "--model-draft" not in plain and plain[plain.index("--threads") + 1] == "2"
    assert drafted[drafted.index("--model-draft") + 1] == "d.gguf"
    assert drafted[drafted.index("--spec-type") + 1] == "draft-simple"
    assert drafted[drafted.index("--threads-draft") + 1] == "2"


def _run(tps: float, tokens: list[int]) -> dict:
    return {"decode_tps": tps, "token_ids": tokens}


def test_each_peer_family_has_its_best_method_compared():
    same = [1, 2, 3]
    runs = {report.TARGET_ONLY: _run(10.0, same), report.AUTO: _run(12.0, same),
            report.LOOKUP: {**_run(9.0, same), "stats": {"ngram_draft_tokens": 4, "ngram_accepted_tokens": 3}},
            llama_server.PLAIN: _run(16.0, same),
            llama_server.WITH_DRAFT: _run(8.0, [1, 2, 4]), "hf generate": _run(4.0, same)}
    summary = report.analyse_prompt(runs)
    assert summary["best_llama-server"] == llama_server.PLAIN
    assert summary[f"{report.AUTO} / best llama-server"] == pytest.approx(12.0 / 16.0)
    assert summary[f"{report.LOOKUP} / best llama-server"] == pytest.approx(9.0 / 16.0)
    assert summary[f"{report.AUTO} / best hf"] == pytest.approx(3.0)
    assert summary["lookup_alpha"] == pytest.approx(0.75)
    assert runs[llama_server.WITH_DRAFT]["identical"] is False and runs[llama_server.PLAIN]["identical"]
    prompts = [{"name": "p", "kind": "k", "summary": summary, "runs": runs}]
    overall = report.overall(prompts)
    assert overall[f"min {report.AUTO} / best llama-server"] == pytest.approx(0.75)
    text = report.table(prompts, list(runs))
    head = text.splitlines()[0]
    assert "auto/ls" in head and "auto/HF" in head and "0.75" in text.splitlines()[1]
    del runs["hf generate"]
    without_hf = report.table([{**prompts[0], "summary": report.analyse_prompt(runs)}], list(runs))
    assert "auto/ls" in without_hf.splitlines()[0] and "auto/HF" not in without_hf.splitlines()[0]
