"""A TCP proxy that plays a network link: each direction delayed (with jitter), cut on demand.

This machine's kernel has no netem qdisc, so the chaos soak (bench/chaos.py) and
bench/overhead.py --link-delay-ms put one of these in front of each service. Every chunk read
from one side is written to the other `delay ± jitter` later (uniform jitter, never before an
earlier chunk: the byte stream keeps its order, as TCP does); threads sleep with the kernel's
clock (sub-millisecond, unlike an event loop's millisecond timer). A cut link closes every
connection through it and refuses new ones until it is healed.

Usage (a process of its own, commands on stdin; prints "listening HOST PORT" once up):
  python bench/link_proxy.py --listen HOST:PORT --to HOST:PORT [--delay-ms 0.3] [--jitter-ms 0.1]
  stdin: "delay D J" | "cut" | "heal" | "quit"
"""

from __future__ import annotations

import argparse
import queue
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass

CHUNK_BYTES = 1 << 16
CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class LinkDelay:
    """One direction's delay: every chunk waits delay_ms ± jitter_ms (uniform), at least 0."""

    delay_ms: float = 0.0   # mean one-way delay
    jitter_ms: float = 0.0  # half-width of the uniform jitter around it

    def draw(self, rng: random.Random) -> float:
        """One chunk's delay, in seconds."""
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return max(0.0, self.delay_ms + jitter) / 1000.0


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class LinkProxy:
    """Listens on `listen`, forwards every connection to `target` through a delayed link."""

    def __init__(self, target: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 delay: LinkDelay = LinkDelay(), seed: int = 0):
        self.target = target
        self.delay = delay  # read by every pipe at each chunk: set_delay applies at once
        self.rng = random.Random(seed)
        self.cut_now = False
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.server = socket.create_server(listen, reuse_port=False)
        self.closed = threading.Event()
        self.accepted = 0  # connections taken (refused ones included)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.getsockname()[:2]
        return host, port

    def start(self) -> "LinkProxy":
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()
        return self

    def set_delay(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        self.delay = LinkDelay(delay_ms, jitter_ms)

    def cut(self) -> None:
        """Close every connection through the link and refuse new ones until heal()."""
        with self.lock:
            self.cut_now = True
            connections, self.connections = self.connections, set()
        for sock in connections:
            _close(sock)

    def heal(self) -> None:
        with self.lock:
            self.cut_now = False

    def close(self) -> None:
        self.closed.set()
        _close(self.server)
        self.cut()

    def __enter__(self) -> "LinkProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the link ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._connect, args=(client,), name="link-connect", daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        if self.cut_now:
            _close(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            _close(client)
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            if self.cut_now:
                for sock in (client, upstream):
                    _close(sock)
                return
            self.connections.update((client, upstream))
        for src, dst in ((client, upstream), (upstream, client)):
            self._pipe(src, dst)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        """One direction: a reader stamps each chunk with its release time, a writer sends it then."""
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            last = 0.0
            while True:
                try:
                    data = src.recv(CHUNK_BYTES)
                except OSError:
                    data = b""
                with self.lock:
                    wait = self.delay.draw(self.rng)
                last = max(last, time.monotonic() + wait)  # never before an earlier chunk
                chunks.put((last, data))
                if not data:
                    return

        def write() -> None:
            while True:
                release, data = chunks.get()
                pause = release - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                if not data:
                    _shutdown_write(dst)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    for sock in (src, dst):
                        _close(sock)
                    return

        threading.Thread(target=read, name="link-read", daemon=True).start()
        threading.Thread(target=write, name="link-write", daemon=True).start()


def _shutdown_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: a free one)")
    parser.add_argument("--to", required=True, help="HOST:PORT of the service behind the link")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter around the delay")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter")
    args = parser.parse_args()
    proxy = LinkProxy(parse_address(args.to), parse_address(args.listen), LinkDelay(args.delay_ms, args.jitter_ms),
                      seed=args.seed).start()
    host, port = proxy.address
    print(f"listening {host} {port}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "delay":
            proxy.set_delay(float(words[1]), float(words[2]) if len(words) > 2 else 0.0)
        elif words[0] == "cut":
            proxy.cut()
        elif words[0] == "heal":
            proxy.heal()
        elif words[0] == "quit":
            break
        else:
            print(f"unknown command {words[0]!r}: delay D J | cut | heal | quit", file=sys.stderr, flush=True)
    proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
