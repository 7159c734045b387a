"""A byte-level store of K/V chunks shared by every replica of a model service.

A model service (draft or target) can persist the K/V of a prefix as *chunks*: opaque values
of a few MB, each under a 32-byte digest key computed by the chunk codec from what the chunk
holds. Another replica that is asked to continue the same prefix reads the chunks back instead
of recomputing them. This module moves bytes only; it knows nothing of tensors or models.

- ``ChunkStore`` is the interface: ``get_many`` / ``stream`` / ``put_many`` / ``ping`` /
  ``close``. ``RedisChunkStore`` keeps the chunks in Redis — one server, a Sentinel-watched
  primary or a Redis Cluster, whose slots spread the keys over every primary (the key is the
  namespace + the digest's hex, every value with a TTL) — ``MemoryChunkStore`` in a dict
  (tests, development).
- ``stream`` is the restore path: one pipeline of GETs per node, each value received into the
  caller's reused buffer on a reader thread while the caller decodes the one before
  (pipelined_read.py).
- The store is a cache, never a dependency: a read from a store that is down or slow returns
  all misses (``None``) and never raises, and the store then backs off — for ``retry_s`` it
  answers every read with misses at once, without touching the network — so an outage costs
  a model service recomputation, never latency or errors.
- ``ChunkWriter`` (writer.py) writes to it on a background thread.
- ``ChunkStoreStats`` is a snapshot of the counters the store and its writer share
  (chunk_stats.py).

``open_chunk_store(url, ttl_s)`` builds the store a URL names: "" (off), ``memory://``, or a
``redis://`` / ``rediss://`` / ``unix://`` / ``redis+sentinel://`` / ``redis+cluster://`` URL
(specdec/redis_url.py; a password in the URL is never logged).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from contextlib import closing
from collections.abc import Iterator, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.retry import Retry

from specdec.errors import Unavailable
from specdec.kv.chunk_stats import ChunkCounters, ChunkStoreStats
from specdec.kv.pipelined_read import pipelined_values
from specdec.logtag import redacted_url
from specdec.redis_url import REDIS_ERRORS, SCHEMES, Topology, parse_redis_url, redis_client

log = logging.getLogger(__name__)

REDIS_SCHEMES = tuple(SCHEMES)  # redis, rediss, unix, redis+sentinel, redis+cluster, rediss+…
URL_FORMS = ("a redis://, rediss:// or unix:// URL (one server), redis+sentinel://HOST:26379,…/SERVICE "
             "or redis+cluster://HOST:6379,HOST:6379,…")
STORE_ERRORS = (*REDIS_ERRORS, OSError)  # what a call to Redis raises when it fails
MEMORY_URL = "memory://"
MEMORY_STORE_MAX_BYTES = 1 << 30  # what `open_chunk_store("memory://")` keeps at most
MiB = 1 << 20


def check_key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"chunk keys are bytes digests, got {type(key).__name__}")
    return key


def as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"chunk values are bytes, got {type(value).__name__}")


class ChunkStore(ABC):
    """Where K/V chunks live: values of bytes under bytes digests. Thread-safe.

    `get_many` never raises for the store's own failures: a chunk it cannot read is a miss."""

    def __init__(self) -> None:
        self.counters = ChunkCounters()

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, in order; None for a key the store does not hold or cannot
        read now."""

    def stream(self, keys: Sequence[bytes], buffers: Sequence[memoryview] = ()) -> Iterator[memoryview | None]:
        """The value of each key, in order, as a memoryview; None for a miss. With `buffers`
        (writable, each the size of a chunk) a value may be read into buffers[i % len(buffers)]
        and is valid only until the caller asks for the next one (two or more buffers); the
        caller may stop early. Never raises for the store's own failures."""
        for value in self.get_many(keys):
            yield None if value is None else memoryview(value)

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store each (key, value), replacing what a key held. Raises `Unavailable` when the
        store cannot be written (the caller decides whether to drop or retry)."""

    @abstractmethod
    def ping(self) -> bool:
        """Whether the store answers now (it asks the store, back-off or not)."""

    @property
    def healthy(self) -> bool:
        """False after a failed call, until a call succeeds again."""
        return True

    def available(self) -> bool:
        """False while calls would fail at once (a back-off after a failure): the writer then
        drops chunks without producing them."""
        return True

    def stats(self) -> ChunkStoreStats:
        return self.counters.snapshot()

    def close(self) -> None:
        """Release connections; the store is not used again."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class MemoryChunkStore(ChunkStore):
    """A dict in this process (tests, development): not shared with other replicas.

    With `ttl_s` a value expires that long after its last write; with `max_bytes` the least
    recently used values are dropped to keep the total at most that."""

    def __init__(self, ttl_s: float | None = None, max_bytes: int | None = None):
        super().__init__()
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"chunk TTL must be positive seconds, got {ttl_s!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes!r}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._values: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()  # key → (value, expires at)
        self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = [check_key(k) for k in keys]
        now = time.monotonic()
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                entry = self._values.get(key)
                if entry is not None and entry[1] <= now:
                    self._drop(key)
                    entry = None
                if entry is not None:
                    self._values.move_to_end(key)
                out.append(None if entry is None else entry[0])
        found = [v for v in out if v is not None]
        self.counters.add(hits=len(found), misses=len(out) - len(found),
                          bytes_read=sum(len(v) for v in found))
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        items = [(check_key(k), as_bytes(v)) for k, v in items]
        expires = time.monotonic() + self.ttl_s if self.ttl_s is not None else float("inf")
        with self._lock:
            for key, value in items:
                if key in self._values:
                    self._drop(key)
                self._values[key] = (value, expires)
                self._bytes += len(value)
            while self.max_bytes is not None and self._bytes > self.max_bytes and self._values:
                self._drop(next(iter(self._values)))
        self.counters.add(chunks_written=len(items), bytes_written=sum(len(v) for _, v in items))

    def _drop(self, key: bytes) -> None:
        value, _ = self._values.pop(key)
        self._bytes -= len(value)

    def ping(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"MemoryChunkStore(ttl_s={self.ttl_s}, max_bytes={self.max_bytes})"


class RedisChunkStore(ChunkStore):
    """Chunks in Redis, shared by every replica: key `namespace + digest.hex()`, each value
    written with SET … EX ttl_s (PX when ttl_s has a fraction of a second). The URL names one
    server, a Sentinel primary or a Cluster (the keys' hash slots spread them over every
    primary).

    `get_many` and `stream` send one pipeline of GETs per node, `put_many` one pipelined round
    trip per node. A failed call (down, a
    timeout after `socket_timeout_s`, refused credentials) marks the store unhealthy; then for
    `retry_s` reads return all None and writes raise `Unavailable` at once, without touching
    the network, after which one call tries again."""

    def __init__(self, url: str, ttl_s: float, namespace: str = "specdec:kv:",
                 socket_timeout_s: float = 2.0, retry_s: float = 5.0):
        super().__init__()
        self.url = redacted_url(url)  # never the password: this is what messages show
        scheme, sep, _ = url.partition("://")
        if not sep or scheme.lower() not in REDIS_SCHEMES:
            raise ValueError(
                f"chunk store URL {self.url!r} has "
                + (f"the scheme {scheme + '://'!r}" if sep else "no scheme")
                + "; a Redis chunk store needs redis://, rediss:// (TLS), unix://, "
                  "redis+sentinel:// or redis+cluster://, e.g. redis://:PASSWORD@HOST:6379/0")
        try:
            self.topology = parse_redis_url(url).topology
        except ValueError as exc:
            raise ValueError(f"invalid chunk store URL {self.url!r}: {exc}") from None
        if not ttl_s > 0:
            raise ValueError(f"chunk TTL must be positive seconds, got {ttl_s!r}")
        if not socket_timeout_s > 0:
            raise ValueError(f"socket_timeout_s must be positive, got {socket_timeout_s!r}")
        if retry_s < 0:
            raise ValueError(f"retry_s must be >= 0, got {retry_s!r}")
        self.ttl_s = ttl_s
        self.namespace = namespace
        self.retry_s = retry_s
        # whole seconds as EX; a fraction as PX (rounded, at least 1 ms)
        self._expiry = ({"ex": int(ttl_s)} if float(ttl_s).is_integer()
                        else {"px": max(1, round(ttl_s * 1000))})
        self._open = lambda: redis_client(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            # one immediate retry of a broken connection (a pooled socket the server closed);
            # never of a timeout, so a call fails within about socket_timeout_s
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._lock = threading.Lock()
        self._healthy = True
        self._retry_at = 0.0  # monotonic time before which calls do not touch the network
        self._last_error = ""
        self._client = None  # a Cluster client asks a node for the slot map when made: see _redis
        try:
            if self.topology is not Topology.CLUSTER:
                self._client = self._open()  # connects on first use
        except (ValueError, TypeError) as exc:
            message = str(exc)
            for secret in _secrets(url):
                message = message.replace(secret, "***")
            raise ValueError(f"invalid chunk store URL {self.url!r}: {message}") from None

    def _redis(self):
        """The redis-py client (made on first use for a Cluster, so that a cluster down when
        the service starts costs misses, not the start); raises one of STORE_ERRORS."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._open()
                client = self._client
        return client

    def _pool_of(self, client):
        """name -> the connection pool of the node holding it."""
        if self.topology is Topology.CLUSTER:
            return lambda name: client.get_redis_connection(client.get_node_from_key(name)).connection_pool
        return lambda name: client.connection_pool

    def __repr__(self) -> str:
        return f"RedisChunkStore({self.url!r}, ttl_s={self.ttl_s}, namespace={self.namespace!r})"

    @property
    def healthy(self) -> bool:
        return self._healthy

    def available(self) -> bool:
        return self._healthy or time.monotonic() >= self._retry_at

    def _name(self, key: bytes) -> str:
        return self.namespace + check_key(key).hex()

    def _may_call(self) -> bool:
        """Whether to ask the store now; while unhealthy only one caller per retry_s does."""
        with self._lock:
            if self._healthy:
                return True
            now = time.monotonic()
            if now < self._retry_at:
                return False
            self._retry_at = now + self.retry_s
            return True

    def _failed(self, exc: BaseException) -> None:
        error = f"{exc.__class__.__name__}: {exc}"
        with self._lock:
            was_healthy, self._healthy = self._healthy, False
            self._retry_at = time.monotonic() + self.retry_s
            self._last_error = error
        if was_healthy:
            log.warning("chunk store %s is unreachable or refused us (%s); reads return misses "
                        "and writes are dropped, retrying every %.1f s", self.url, error, self.retry_s)
        else:
            log.debug("chunk store %s still unreachable (%s)", self.url, error)

    def _succeeded(self) -> None:
        if self._healthy:
            return
        with self._lock:
            was_healthy, self._healthy = self._healthy, True
        if not was_healthy:
            log.info("chunk store %s is reachable again", self.url)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None if v is None else bytes(v) for v in self.stream(keys)]

    def stream(self, keys: Sequence[bytes], buffers: Sequence[memoryview] = ()) -> Iterator[memoryview | None]:
        names = [self._name(k) for k in keys]
        if not names:
            return
        if not self._may_call():
            self.counters.add(reads_skipped=1)
            yield from [None] * len(names)
            return
        done = 0  # values handed to the caller
        for attempt in (1, 2):  # a second try only for a broken pooled connection, before any value
            try:
                with closing(pipelined_values(names, self._pool_of(self._redis()), buffers)) as values:
                    for value in values:  # stopped early: closing() lets go of the connections now
                        done += 1
                        self.counters.add(**({"misses": 1} if value is None else {"hits": 1, "bytes_read": len(value)}))
                        yield value
                self._succeeded()
                return
            except ResponseError as exc:  # MOVED during a resharding, WRONGTYPE...: not an outage
                self._refused(exc)
                break
            except STORE_ERRORS as exc:
                if attempt == 1 and done == 0 and isinstance(exc, RedisConnectionError):
                    continue
                self._failed(exc)
                self.counters.add(read_errors=1)
                break
        yield from [None] * (len(names) - done)

    def _refused(self, exc: ResponseError) -> None:
        """A GET answered with an error: the rest are misses; a cluster reloads its slot map."""
        self.counters.add(read_errors=1)
        log.warning("chunk store %s refused a read (%s); prefilling instead", self.url, exc)
        if self.topology is Topology.CLUSTER and self._client is not None:
            try:
                self._client.nodes_manager.initialize()
            except STORE_ERRORS:
                pass

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        items = [(self._name(k), as_bytes(v)) for k, v in items]
        if not items:
            return
        if not self._may_call():
            raise Unavailable(f"chunk store {self.url} is unreachable ({self._last_error}); "
                              f"not retrying for up to {self.retry_s:.1f} s")
        try:
            with self._redis().pipeline(transaction=False) as pipe:
                for name, value in items:
                    pipe.set(name, value, **self._expiry)
                pipe.execute()
        except STORE_ERRORS as exc:
            self._failed(exc)
            raise Unavailable(f"chunk store {self.url} is unreachable or refused us "
                              f"({exc.__class__.__name__}: {exc}); the chunks were not written") from None
        self._succeeded()
        self.counters.add(chunks_written=len(items), bytes_written=sum(len(v) for _, v in items))

    def ping(self) -> bool:
        try:
            self._redis().ping()
        except STORE_ERRORS as exc:
            self._failed(exc)
            return False
        self._succeeded()
        return True

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _secrets(url: str) -> list[str]:
    """The credentials in `url` (user info, password= values), longest first."""
    out: list[str] = []
    try:
        parts = urlsplit(url)
        if parts.password:
            out += [parts.password, unquote(parts.password)]
        if parts.username:
            out += [parts.username, unquote(parts.username)]
        out += [v for k, v in parse_qsl(parts.query) if k.lower() == "password"]
    except ValueError:
        pass
    return sorted({s for s in out if s}, key=len, reverse=True)


def open_chunk_store(url: str, ttl_s: float) -> ChunkStore | None:
    """The chunk store `url` names: "" → None (no store); `memory://` → a `MemoryChunkStore`
    of this process (at most MEMORY_STORE_MAX_BYTES); redis://, rediss:// or unix:// → a
    `RedisChunkStore` shared by every replica (redis+sentinel:// and redis+cluster:// too).
    Values expire `ttl_s` after their last write."""
    if url == "":
        return None
    if url == MEMORY_URL:
        return MemoryChunkStore(ttl_s=ttl_s, max_bytes=MEMORY_STORE_MAX_BYTES)
    scheme, sep, _ = url.partition("://")
    if sep and scheme.lower() in REDIS_SCHEMES:
        return RedisChunkStore(url, ttl_s=ttl_s)
    raise ValueError(f"unsupported chunk store URL {redacted_url(url)!r}: use '' (no store), "
                     f"'memory://' (this process only), or {URL_FORMS}")
