"""Replica discovery: static lists, and Kubernetes EndpointSlices watched through a local fake API.

Here the service tests; the other tiers' are in tests/unit/test_discovery.py and
tests/e2e/test_discovery.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.sessions.discovery import KubernetesDiscovery, ServiceRef
from tests.cluster import LoopThread
from tests.fake_kubernetes import FakeKubernetes

NS = "specdec"


class Seen:
    """What a discovery reported, per tier, and on which thread."""

    def __init__(self) -> None:
        self.addresses: dict[str, frozenset] = {}
        self.threads: set[str] = set()
        self.cond = threading.Condition()

    def on_change(self, tier: str, addresses: frozenset) -> None:
        with self.cond:
            self.addresses[tier] = addresses
            self.threads.add(threading.current_thread().name)
            self.cond.notify_all()

    def wait(self, tier: str, expected: set[str], timeout: float = 20.0) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.addresses.get(tier) == expected, timeout)
            assert ok, (tier, self.addresses.get(tier), expected)


@pytest.fixture
def api():
    fake = FakeKubernetes().start()
    yield fake
    fake.stop()


def test_kubernetes_endpointslices_list_watch_relist(api, tmp_path):
    api.put(NS, "draft-a", "draft-svc", [("10.0.0.1", True), ("10.0.0.2", True)])
    api.put(NS, "target-a", "target-svc", [("10.0.1.1", None)])
    api.put(NS, "other", "unrelated", [("10.9.9.9", True)])  # another Service
    api.put("elsewhere", "draft-x", "draft-svc", [("10.8.8.8", True)])  # another namespace
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    discovery = KubernetesDiscovery([ServiceRef("draft", "draft-svc", 50052),
                                     ServiceRef("target", "target-svc", 50053)], kubeconfig=str(kubeconfig))
    assert discovery.namespace == NS  # from the kubeconfig context
    loop, seen = LoopThread(), Seen()
    loop.loop.call_soon_threadsafe(discovery.start, loop.loop, seen.on_change)
    try:
        seen.wait("draft", {"10.0.0.1:50052", "10.0.0.2:50052"})
        seen.wait("target", {"10.0.1.1:50053"})
        # a pod becomes not ready
        api.put(NS, "draft-a", "draft-svc", [("10.0.0.1", True), ("10.0.0.2", False)])
        seen.wait("draft", {"10.0.0.1:50052"})
        # a pod is added (in a new slice)
        api.put(NS, "draft-b", "draft-svc", [("10.0.0.3", True)])
        seen.wait("draft", {"10.0.0.1:50052", "10.0.0.3:50052"})
        # the watch expires (410 Gone) and the next list fails once: re-list with backoff
        lists_before = api.lists("draft-svc")
        api.fail_lists["draft-svc"] = 1
        api.expire()
        api.put(NS, "draft-b", "draft-svc", [("10.0.0.3", True), ("10.0.0.4", True)])
        seen.wait("draft", {"10.0.0.1:50052", "10.0.0.3:50052", "10.0.0.4:50052"})
        wait_until(lambda: api.lists("draft-svc") >= lists_before + 2)  # the failed re-list, then the good one
        # the watch goes on after the re-list
        api.delete(NS, "draft-a")
        seen.wait("draft", {"10.0.0.3:50052", "10.0.0.4:50052"})
        seen.wait("target", {"10.0.1.1:50053"})
        watches = [q for kind, q in api.requests if kind == "watch"]
        assert all(q["labelSelector"].startswith("kubernetes.io/service-name=") for q in watches)
        assert all(q.get("resourceVersion") for q in watches)  # every watch resumes from a version
        assert seen.threads == {loop.thread.name}  # changes are handed to the asyncio loop
    finally:
        loop.run(discovery.close())
        loop.close()
    assert not any(t.is_alive() for t in discovery._threads)


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
