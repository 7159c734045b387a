"""The ports a command will bind, checked before it loads anything: each names its flag."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Binding:
    """A port a command's services will listen on."""

    port: int   # the port number
    what: str   # what listens there ("the draft service's gRPC API")
    flag: str   # the flag that chooses it ("--draft-port")


def problem(binding: Binding, host: str) -> str | None:
    """Why `binding` cannot be bound on `host` now (None: it can). The probe sets SO_REUSEADDR
    as the servers do, so a port only in TIME_WAIT counts as free."""
    if not 1 <= binding.port <= 65535:
        return (f"port {binding.port} ({binding.what}) is not a port number (1-65535); "
                f"choose another with {binding.flag}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, binding.port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            return f"port {binding.port} {why}; choose another with {binding.flag} (it is {binding.what})"
    return None


def check(bindings: Sequence[Binding], host: str = "127.0.0.1") -> None:
    """Refuse (SystemExit naming the flag to change) a port that is taken, out of range, or
    planned twice."""
    seen: dict[int, Binding] = {}
    for binding in bindings:
        earlier = seen.get(binding.port)
        if earlier is not None:
            raise SystemExit(f"port {binding.port} would be both {earlier.what} ({earlier.flag}) and "
                             f"{binding.what} ({binding.flag}); choose another with one of them")
        seen[binding.port] = binding
        reason = problem(binding, host)
        if reason is not None:
            raise SystemExit(reason)
