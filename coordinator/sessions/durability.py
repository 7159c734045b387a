"""How many replicas must hold a round's commit before its tokens stream: --session-durability.

  none                        the primary's word (Redis replicates asynchronously: a failover
                              can lose the last writes, tokens a client already received)
  replicas=N[,timeout_ms=T]   after each write, WAIT N T: the write is acknowledged only when N
                              replicas have it; fewer within T ms and the request fails with
                              UNAVAILABLE (retryable), its tokens never streamed
"""

from __future__ import annotations

from dataclasses import dataclass

NONE = "none"
DEFAULT_TIMEOUT_MS = 1000
FORMS = "'none' or 'replicas=N[,timeout_ms=T]' (e.g. replicas=1,timeout_ms=1000)"


@dataclass(frozen=True)
class Durability:
    replicas: int = 0  # 0: none, no WAIT
    timeout_ms: int = DEFAULT_TIMEOUT_MS

    @property
    def waits(self) -> bool:
        return self.replicas > 0

    def __str__(self) -> str:
        return f"replicas={self.replicas},timeout_ms={self.timeout_ms}" if self.waits else NONE


def _positive(text: str, key: str, setting: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--session-durability {setting!r}: {key} must be a whole number >= 1, "
                         f"got {text!r}; use {FORMS}")
    return int(text)


def parse_durability(setting: str) -> Durability:
    """The Durability `setting` spells; ValueError saying what is wrong."""
    text = setting.strip().lower()
    if text == NONE:
        return Durability()
    values: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("replicas", "timeout_ms") or key in values:
            raise ValueError(f"--session-durability {setting!r} is not {FORMS}")
        values[key] = _positive(value.strip(), key, setting)
    if "replicas" not in values:
        raise ValueError(f"--session-durability {setting!r} names no replicas=N; use {FORMS}")
    return Durability(values["replicas"], values.get("timeout_ms", DEFAULT_TIMEOUT_MS))


def short_error(got: int, durability: Durability) -> str:
    """The message of a commit fewer replicas than asked confirmed in time."""
    return (f"the session store's commit of this round reached {got} of the {durability.replicas} "
            f"replica(s) --session-durability asks for within {durability.timeout_ms} ms (a "
            "replica down or a failover under way); nothing of it was streamed: retry")
