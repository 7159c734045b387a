"""The coordinator: the public APIs, the sessions and the round loop between them.

It runs no model: each round it plans, asks a proposal source for tokens, has the target verify
them, commits and streams. Its wings (tests/unit/test_layers.py holds each to what it may import):

* `coordinator.api` — the gRPC servicer and the OpenAI-compatible HTTP API: requests in, chunks
  out, through the round loop only;
* the round loop at the top — `round_loop.py` (`RoundLoop`: plan, propose, verify, commit,
  store, stream), `rounds.py` (what a request and its rounds carry), `request.py`,
  `session_calls.py` (the calls to a session's replicas, and the one owner of what each holds),
  `stats.py`, `streamed_text.py`, `detokenizer.py`, `chat.py`, `tasks.py`, `recording.py`
  (training records of finished requests), and `server.py`,
  which composes everything;
* `coordinator.sources` — the proposal sources behind one interface (draft model, prompt
  lookup, the target's heads, none);
* `coordinator.policy` — what each round does: the planner, the acceptance and cost estimates,
  the load governor and the draft-ahead trial;
* `coordinator.sessions` — the session store, leases, replicas (discovery, routing, clients).
"""
