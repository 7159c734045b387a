"""A TCP echo server on loopback for the link proxy's tests."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator


@contextlib.contextmanager
def echo_server() -> Iterator[tuple[str, int]]:
    """An echo server on 127.0.0.1, each connection on a thread of its own: its address."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[:2]
    finally:
        server.close()
