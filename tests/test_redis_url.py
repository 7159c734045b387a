"""specdec/redis_url.py: the three URL forms read, bad ones refused with a precise message."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
import redis.cluster

from specdec.redis_url import REDIS_ERRORS, Topology, parse_redis_url, redis_client

pytestmark = pytest.mark.unit


def test_single_server_urls_are_passed_through():
    for url in ("redis://h:6379/2", "rediss://:pw@h:6380/0", "unix:///tmp/r.sock?db=3"):
        target = parse_redis_url(url)
        assert target.topology is Topology.SINGLE and target.url == url
    assert parse_redis_url("rediss://h").tls


def test_sentinel_url_nodes_service_db_password():
    target = parse_redis_url("redis+sentinel://:s%40cret@a:26380,b,[::1]:26381/mymaster/4"
                             "?sentinel_password=x")
    assert target.topology is Topology.SENTINEL
    assert target.nodes == (("a", 26380), ("b", 26379), ("::1", 26381))
    assert (target.service, target.db, target.password) == ("mymaster", 4, "s@cret")
    assert target.option("sentinel_password") == "x"
    assert parse_redis_url("redis+sentinel://a/svc").db == 0


def test_cluster_url_nodes_and_user():
    target = parse_redis_url("rediss+cluster://app:pw@n1:7000,n2:7001/")
    assert target.topology is Topology.CLUSTER and target.tls
    assert target.nodes == (("n1", 7000), ("n2", 7001))
    assert (target.username, target.password) == ("app", "pw")
    assert parse_redis_url("redis+cluster://n1").nodes == (("n1", 6379),)


@pytest.mark.parametrize("url, says", [
    ("http://h:6379", "scheme http://"),
    ("localhost:6379", "scheme (none)"),
    ("redis+sentinel://:hunter2@a:26379", "ends with /SERVICE_NAME"),
    ("redis+sentinel://:hunter2@a:26379/m/x", "database 'x' is not a number"),
    ("redis+sentinel://a:26379/m/0/extra", "ends with /SERVICE_NAME"),
    ("redis+cluster://:hunter2@a:7000/3", "database 0 only"),
    ("redis+cluster://a:port", "not a number from 1 to 65535"),
    ("redis+cluster://a:70000", "not a number from 1 to 65535"),
    ("redis+cluster://", "names no host"),
    ("redis+cluster://:7000", "names no host"),
    ("redis+cluster://a:7000?socket_timeout=1", "option 'socket_timeout' is not known"),
])
def test_malformed_urls_say_what_is_wrong_without_the_password(url, says):
    with pytest.raises(ValueError) as caught:
        parse_redis_url(url)
    assert says in str(caught.value)
    assert "hunter2" not in str(caught.value)
    assert "redis+sentinel://" in str(caught.value)  # the forms are listed


def test_clients_of_each_form_and_flavour():
    """Opening makes no connection: each form gives the client class it promises."""
    assert type(redis_client("redis://h:1/0")) is redis.Redis
    assert type(redis_client("redis://h:1/0", asyncio=True)) is redis.asyncio.Redis
    sentinel = redis_client("redis+sentinel://:pw@a:1,b:2/svc/3", socket_timeout=1.0)
    assert isinstance(sentinel, redis.Redis)
    assert sentinel.connection_pool.service_name == "svc"
    assert sentinel.connection_pool.connection_kwargs["db"] == 3
    assert sentinel.connection_pool.connection_kwargs["password"] == "pw"
    aio_sentinel = redis_client("redis+sentinel://a:1/svc", asyncio=True)
    assert isinstance(aio_sentinel, redis.asyncio.Redis)
    with pytest.raises(REDIS_ERRORS):  # nothing listens: the cluster's slot map cannot load
        redis_client("redis+cluster://127.0.0.1:1", socket_connect_timeout=0.2)
    assert redis_client.__module__ == "specdec.redis_url"
