"""Redis with replicas on loopback, owned by a test: a primary, replicas and sentinels
(`SentinelGroup`), or a Redis Cluster of primaries each with a replica (`ClusterGroup`).
Detection is fast (down-after-milliseconds / cluster-node-timeout 1000) so failovers take
seconds; every process is stopped by `stop()`."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.redis_server import RedisServer, free_port, redis_binary

SERVICE = "specdec"
DOWN_AFTER_MS = 1000


FAST_SYNC = ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once, not after 5 s


def online_replicas(server: RedisServer) -> int:
    """The replicas of `server` that finished their sync (WAIT counts only these)."""
    info = server.client(socket_timeout=1).info("replication")
    return sum(1 for key, value in info.items()
               if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")


def _wait(predicate, what: str, timeout_s: float = 30.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(every_s)


class SentinelGroup:
    """One primary, `replicas` replicas, `sentinels` sentinels (quorum 2) watching SERVICE."""

    def __init__(self, directory: Path, replicas: int = 2, sentinels: int = 3, extra: list[str] | None = None):
        self.directory = Path(directory)
        self.extra = extra or []
        self.servers = [RedisServer(self.directory / f"redis{i}", extra=[*FAST_SYNC, *self.extra])
                        for i in range(1 + replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> "SentinelGroup":
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "SentinelGroup":
        primary = self.servers[0].start()
        for replica in self.servers[1:]:
            replica.extra += ["--replicaof", "127.0.0.1", str(primary.port)]
            replica.start()
        _wait(lambda: online_replicas(primary) == len(self.servers) - 1, "the replicas to sync")
        for i, port in enumerate(self.sentinel_ports):
            conf = self.directory / f"sentinel{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
                f"sentinel parallel-syncs {SERVICE} 2\n")
            self.sentinels.append(subprocess.Popen([redis_binary(), str(conf), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=1)
            _wait(lambda c=client: len(c.sentinel_sentinels(SERVICE)) == len(self.sentinel_ports) - 1
                  and len(c.sentinel_slaves(SERVICE)) == len(self.servers) - 1, "the sentinels to meet")
        return self

    def primary(self) -> RedisServer:
        """The server the sentinels name primary now."""
        client = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1)
        _host, port = client.sentinel_get_master_addr_by_name(SERVICE)
        return next(server for server in self.servers if server.port == int(port))

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.kill()
            proc.wait(10)
        self.sentinels = []
        for server in self.servers:
            server.stop()


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, both below 65536."""
    while True:
        port = random.randrange(20000, 50000)
        if _bindable(port) and _bindable(port + 10000):
            return port


class ClusterGroup:
    """A Redis Cluster of `primaries` primaries with one replica each."""

    def __init__(self, directory: Path, primaries: int = 3):
        self.directory = Path(directory)
        self.servers = [RedisServer(self.directory / f"node{i}", port=cluster_port(), extra=[
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(DOWN_AFTER_MS), *FAST_SYNC]) for i in range(2 * primaries)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers[:2])

    def start(self) -> "ClusterGroup":
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "ClusterGroup":
        for server in self.servers:
            server.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{s.port}" for s in self.servers),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        def ok() -> bool:
            return all(s.client(socket_timeout=1).cluster("info")["cluster_state"] == "ok"
                       for s in self.servers if s.proc is not None)
        _wait(ok, "the cluster to be ok", timeout_s)

        def synced() -> bool:
            live = [s for s in self.servers if s.proc is not None]
            primaries = [s for s in live if s.client(socket_timeout=1).info("replication")["role"] == "master"]
            return all(online_replicas(p) >= 1 for p in primaries)
        _wait(synced, "every primary's replica to sync", timeout_s)

    def primary_of(self, key: str) -> RedisServer:
        """The server holding `key`'s slot now, as a live node sees it (never the one killed)."""
        client = next(s for s in self.servers if s.proc is not None).client(socket_timeout=1)
        slot = client.cluster("keyslot", key)
        for start, end, primary, *_ in client.cluster("slots"):
            if start <= slot <= end:
                return next(s for s in self.servers if s.port == int(primary[1]))
        raise LookupError(slot)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def migrate_slot(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Move `slot` and its keys from `source` to `target` (both primaries), as
        `redis-cli --cluster reshard` does: IMPORTING / MIGRATING, MIGRATE in batches, then the
        slot assigned on every primary."""
        src, dst = source.client(socket_timeout=5), target.client(socket_timeout=5)
        src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
        dst.cluster("setslot", slot, "importing", src_id)
        src.cluster("setslot", slot, "migrating", dst_id)
        while keys := src.cluster("getkeysinslot", slot, 100):
            src.migrate("127.0.0.1", target.port, keys, 0, 5000)
        for server in self.servers:
            if server.proc is not None and server.client(socket_timeout=1).info("replication")["role"] == "master":
                server.client(socket_timeout=5).cluster("setslot", slot, "node", dst_id)

