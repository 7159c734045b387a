"""Sessions and replicas: the session record and its store (`session_store.py`, `memory_store.py`,
`redis_store.py`, `stores.py`), the lease a request holds (`lease_keeper.py`), the draft and
target tiers (`model_tiers.py`), their replicas and how a session is placed on them
(`discovery.py`, `routing.py`, `clients.py`).

Decides: where a session's state lives and which replica serves it. May import: the shared
library and its own modules only (nothing of rounds, sources or policy).
"""
