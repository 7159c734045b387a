"""Reading K/V chunks from Redis at network speed.

`pipelined_values(names, pool_of, buffers)` sends one pipeline of GETs per node (one server:
one pipeline; a cluster: one per primary holding some of the keys, all sent before any reply is
read) and yields the values in key order. A reader thread parses the replies itself (RESP:
`$<length>\\r\\n<bytes>\\r\\n`, a null, or an error) and reads each value's bytes with
`recv_into` straight into a caller's buffer — no `bytes` object, no Python work per element —
while the caller checks and copies the value before: reading chunk i+1 overlaps decoding
chunk i.

The connections are redis-py's own (taken from each node's pool, so AUTH, SELECT, TLS and the
timeouts are as the client set them) and go back to their pools when every reply was read; a
connection with replies left unread (the caller stopped early, an error) is closed instead.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

LINE_MAX = 1024  # a reply's first line ("$7340104", "-MOVED 1234 10.0.0.1:6379") is shorter
SCRATCH_BYTES = 1 << 16  # what one recv reads while looking for a reply's first line


class RespReader:
    """Replies read off one socket: a small scratch buffer for first lines, values received
    straight into the caller's memory."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.scratch = bytearray(SCRATCH_BYTES)
        self.start = self.end = 0  # unread bytes are scratch[start:end]

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.scratch):  # move the unread tail to the front
            tail = self.scratch[self.start:self.end]
            self.scratch[:len(tail)] = tail
            self.start, self.end = 0, len(tail)
        n = self.sock.recv_into(memoryview(self.scratch)[self.end:])
        if n == 0:
            raise RedisConnectionError("Redis closed the connection in the middle of a reply")
        self.end += n

    def _line(self) -> bytes:
        while True:
            at = self.scratch.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.scratch[self.start:at])
                self.start = at + 2
                return line
            if self.end - self.start > LINE_MAX:
                raise RedisConnectionError("not a Redis reply (no line end)")
            self._fill()

    def _exact(self, dest: memoryview) -> None:
        """Fill dest: first from the scratch buffer, the rest straight from the socket."""
        have = min(self.end - self.start, len(dest))
        dest[:have] = self.scratch[self.start:self.start + have]
        self.start += have
        got = have
        while got < len(dest):
            n = self.sock.recv_into(dest[got:])
            if n == 0:
                raise RedisConnectionError("Redis closed the connection in the middle of a value")
            got += n

    def value(self, buffer: memoryview | None) -> memoryview | None:
        """The next reply: a bulk string (in `buffer` when it fits, else in fresh memory), None
        for a null; ResponseError for an error reply (MOVED, WRONGTYPE, ...)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            dest = buffer[:length] if buffer is not None and length <= len(buffer) else memoryview(bytearray(length))
            self._exact(dest)
            crlf = memoryview(bytearray(2))
            self._exact(crlf)
            if crlf.tobytes() != b"\r\n":
                raise RedisConnectionError("not a Redis reply (a value not followed by CRLF)")
            return dest
        if kind == b"_":  # RESP3 null
            return None
        if kind == b"-":
            raise ResponseError(rest.decode("utf-8", "replace"))
        raise RedisConnectionError(f"unexpected Redis reply {line[:40]!r} to GET")


@dataclass
class _Node:
    """One node's pipeline of GETs."""

    pool: Any  # the redis-py ConnectionPool of the node
    connection: Any = None  # taken from the pool, the GETs sent on it
    reader: RespReader | None = None
    names: list[str] = field(default_factory=list)  # its keys, in key order
    unread: int = 0  # replies not read yet


def _send(nodes: list[_Node]) -> None:
    for node in nodes:
        node.connection = node.pool.get_connection()
        node.unread = len(node.names)
        node.connection.send_packed_command(
            node.connection.pack_commands([("GET", name) for name in node.names]), check_health=False)
        node.reader = RespReader(node.connection._sock)


def _give_back(nodes: list[_Node]) -> None:
    for node in nodes:
        if node.connection is None:
            continue
        if node.unread:  # replies left on the socket: the connection cannot be reused
            node.connection.disconnect()
        node.pool.release(node.connection)
        node.connection = None


def pipelined_values(names: Sequence[str], pool_of: Callable[[str], Any],
                     buffers: Sequence[memoryview] = ()) -> Iterator[memoryview | None]:
    """Each name's value in order (None: not found), read by one pipeline of GETs per node.

    pool_of(name): the connection pool of the node holding `name`. With `buffers`, value i is
    read into buffers[i % len(buffers)] when it fits, and stays valid until the caller asks for
    the value len(buffers) - 1 after it (two buffers: until the next one); without, each value
    is in memory of its own. Raises the first error (ResponseError for a reply such as MOVED,
    RedisConnectionError or OSError for the connection); stopping early is cheap."""
    order: list[_Node] = []
    by_pool: dict[int, _Node] = {}
    for name in names:
        pool = pool_of(name)
        node = by_pool.get(id(pool))
        if node is None:
            node = by_pool[id(pool)] = _Node(pool)
        node.names.append(name)
        order.append(node)
    nodes = list(by_pool.values())
    ahead = threading.Semaphore(len(buffers)) if buffers else None  # buffers the reader may fill
    stop = threading.Event()
    replies: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for i, node in enumerate(order):
                if ahead is not None:
                    ahead.acquire()
                if stop.is_set():
                    return
                value = node.reader.value(buffers[i % len(buffers)] if buffers else None)
                node.unread -= 1
                replies.put((value, None))
        except BaseException as exc:  # handed to the caller
            replies.put((None, exc))

    try:
        _send(nodes)
        reader = threading.Thread(target=read, name="kv-chunk-reader", daemon=True)
        reader.start()
        try:
            for _ in order:
                value, error = replies.get()
                if error is not None:
                    raise error
                yield value
                if ahead is not None:
                    ahead.release()  # the caller is done with the value before this one
        finally:
            stop.set()
            if reader.is_alive():
                for node in nodes:  # wake a reader blocked on a socket or on the buffers
                    if node.unread:
                        _shutdown(node)
                if ahead is not None:
                    ahead.release()
                reader.join()
    finally:
        _give_back(nodes)


def _shutdown(node: _Node) -> None:
    try:
        node.connection._sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass
