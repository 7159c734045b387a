"""The coordinator's public APIs: the gRPC servicer (`servicer.py`) and the OpenAI-compatible HTTP
API (`openai_api.py`, its shapes in `openai_protocol.py`, its ASGI plumbing — event streams,
disconnects, the request counter — in `asgi.py`).

Decides: how a request arrives and how its chunks leave (protobuf or JSON, statuses and HTTP
errors), nothing about how they are generated. May import: the shared library, its own modules,
and the round loop's top-level modules (`round_loop`, `request`, `rounds`, `stats`, ...); not the
sources, the policy or the sessions, which it reaches only through the round loop.
"""
