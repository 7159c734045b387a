"""One Redis URL, three topologies: the client every Redis the project uses is opened with.

  redis://[[user]:password@]host[:port][/db]   one server (rediss:// TLS, unix:///path?db=N a socket),
                                               exactly as redis-py's `from_url` reads it
  redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/SERVICE[/db]
                                               the primary the sentinels name for SERVICE, found
                                               again after a failover (port 26379 by default)
  redis+cluster://[[user]:password@]host[:port][,host[:port]...]
                                               a Redis Cluster; MOVED and ASK followed, the slot
                                               map refreshed (port 6379 by default; db 0 only)

`rediss+sentinel://` and `rediss+cluster://` are the same over TLS. The password is the data
nodes' (`requirepass`); sentinels that need one of their own take `?sentinel_password=`. A
Sentinel client talks to the primary only, never to a replica: nothing it reads can be behind
what it wrote. `parse_redis_url` reads a URL, `redis_client` opens it (sync or asyncio).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

from redis.exceptions import RedisClusterException, RedisError

from specdec.logtag import redacted_url


# what a call on any of the clients raises when Redis fails it: RedisCluster's own errors
# (no reachable node, slot map incomplete) are not RedisErrors
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)


class Topology(enum.Enum):
    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


SINGLE_SCHEMES = ("redis", "rediss", "unix")
SCHEMES = {
    **{scheme: (Topology.SINGLE, scheme == "rediss") for scheme in SINGLE_SCHEMES},
    "redis+sentinel": (Topology.SENTINEL, False), "rediss+sentinel": (Topology.SENTINEL, True),
    "redis+cluster": (Topology.CLUSTER, False), "rediss+cluster": (Topology.CLUSTER, True),
}
DEFAULT_PORT = {Topology.SENTINEL: 26379, Topology.CLUSTER: 6379}
# query options of the sentinel and cluster forms -> where they go
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile")
FORMS = ("redis://[:PASSWORD@]HOST:6379/0, rediss://… (TLS), unix:///PATH?db=0, "
         "redis+sentinel://[:PASSWORD@]HOST:26379[,HOST:26379…]/SERVICE[/DB] or "
         "redis+cluster://[:PASSWORD@]HOST:6379[,HOST:6379…]")


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names. For SINGLE, `url` is handed to redis-py as it is; nodes are empty."""

    topology: Topology
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    options: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def option(self, name: str) -> str | None:
        return dict(self.options).get(name)


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"invalid Redis URL {redacted_url(url)!r}: {why}; the forms are {FORMS}")


def _node(url: str, text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise _bad(url, f"{text!r} is not HOST[:PORT]")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise _bad(url, f"{text!r} names no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"the port of {text!r} is not a number from 1 to 65535")
    return host, int(port_text)


def _db(url: str, text: str) -> int:
    if not text.isdigit():
        raise _bad(url, f"the database {text!r} is not a number")
    return int(text)


def parse_redis_url(url: str) -> RedisTarget:
    """The topology, nodes and settings `url` names; ValueError saying what is wrong (the
    password never shown)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise _bad(url, f"the scheme {scheme + '://' if sep else '(none)'} is not one of "
                        + ", ".join(s + "://" for s in SCHEMES))
    topology, tls = SCHEMES[scheme.lower()]
    if topology is Topology.SINGLE:
        return RedisTarget(Topology.SINGLE, url, tls=tls)
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    nodes = tuple(_node(url, part.strip(), DEFAULT_PORT[topology]) for part in netloc.split(",") if part.strip())
    if not nodes:
        raise _bad(url, "it names no host")
    allowed = (SENTINEL_OPTIONS if topology is Topology.SENTINEL else ()) + (TLS_OPTIONS if tls else ())
    options = tuple(parse_qsl(query, keep_blank_values=True))
    for key, _ in options:
        if key not in allowed:
            raise _bad(url, f"the option {key!r} is not known here (known: {', '.join(allowed) or 'none'})")
    parts = [p for p in path.split("/") if p]
    if topology is Topology.SENTINEL:
        if not parts or len(parts) > 2:
            raise _bad(url, "a sentinel URL ends with /SERVICE_NAME or /SERVICE_NAME/DB (the name "
                            "the sentinels monitor the primary under, e.g. /mymaster/0)")
        service, db = unquote(parts[0]), _db(url, parts[1]) if len(parts) == 2 else 0
    else:
        if len(parts) > 1 or (parts and _db(url, parts[0]) != 0):
            raise _bad(url, "a Redis Cluster has database 0 only: end the URL at the last HOST:PORT")
        service, db = "", 0
    return RedisTarget(topology, url, nodes, service, db, username, password, tls, options)


def _tls_kwargs(target: RedisTarget) -> dict:
    if not target.tls:
        return {}
    return {"ssl": True, **{k: v for k, v in target.options if k in TLS_OPTIONS}}


def redis_client(url: str, *, asyncio: bool = False, **kwargs):
    """A redis-py client of the server, primary or cluster `url` names: `redis.Redis` (a
    Sentinel's master_for client) or `redis.cluster.RedisCluster`, from `redis.asyncio` when
    `asyncio`. `kwargs` are connection settings (socket_timeout, decode_responses, retry...).
    ValueError for a malformed URL. The sync RedisCluster loads the slot map when made, so it
    raises one of REDIS_ERRORS when no node answers; the others connect on first use."""
    target = parse_redis_url(url)
    if target.topology is Topology.SINGLE:
        if asyncio:
            import redis.asyncio as aioredis

            return aioredis.from_url(url, **kwargs)
        import redis

        return redis.Redis.from_url(url, **kwargs)
    auth = {"username": target.username, "password": target.password}
    if target.topology is Topology.SENTINEL:
        return _sentinel_client(target, asyncio, {**auth, **_tls_kwargs(target), **kwargs})
    if asyncio:
        from redis.asyncio.cluster import ClusterNode, RedisCluster
    else:
        from redis.cluster import ClusterNode, RedisCluster
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                        **auth, **_tls_kwargs(target), **kwargs)


def _sentinel_client(target: RedisTarget, asyncio: bool, kwargs: dict):
    if asyncio:
        from redis.asyncio.sentinel import Sentinel
    else:
        from redis.sentinel import Sentinel
    timeouts = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    sentinel_kwargs = {**timeouts, **_tls_kwargs(target),
                       "password": target.option("sentinel_password"),
                       "username": target.option("sentinel_username")}
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(target.service, db=target.db, **kwargs)
