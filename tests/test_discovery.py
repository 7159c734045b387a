"""Replica discovery: static lists, and Kubernetes EndpointSlices watched through a local fake API."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from coordinator.sessions.discovery import (
    DiscoveryError, KubernetesDiscovery, ServiceRef, from_config, parse_addresses, ready_addresses,
)
from specdec_cli import tiny
from specdec.config import CoordinatorConfig, TargetConfig
from target_service import server as target_server
from tests.cluster import Cluster, LoopThread
from tests.fake_kubernetes import FakeKubernetes
from tests.procs import Coordinator

NS = "specdec"


@pytest.mark.unit
def test_static_lists():
    assert parse_addresses("a:1", "--draft") == {"a:1"}
    assert parse_addresses(" a:1, b:2 ,,a:1", "--draft") == {"a:1", "b:2"}
    with pytest.raises(DiscoveryError, match="--target lists no address"):
        parse_addresses(" , ", "--target")
    with pytest.raises(DiscoveryError, match="not host:port"):
        parse_addresses("a:1,b", "--draft")
    with pytest.raises(DiscoveryError, match="needs --draft-service and --target-service"):
        from_config(CoordinatorConfig(discovery="kubernetes"))


@pytest.mark.unit
def test_ready_endpoints_only():
    slices = [
        {"addressType": "IPv4", "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.0.0.3"]},  # ready unset: ready
            {"addresses": [], "conditions": {"ready": True}},
        ]},
        {"addressType": "IPv6", "endpoints": [{"addresses": ["fd00::1", "fd00::2"], "conditions": {}}]},
        {"addressType": "IPv4"},
    ]
    assert ready_addresses(slices, 50052) == {"10.0.0.1:50052", "10.0.0.3:50052", "[fd00::1]:50052"}


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


@pytest.mark.service
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


@pytest.mark.e2e
def test_coordinator_follows_kubernetes_endpoints(api, tmp_path, models, monkeypatch):
    """A coordinator with --discovery kubernetes: uses the ready pods, refuses a target pod that
    joins with another tokenizer, loses the target tier when its only good pod turns not-ready
    (UNAVAILABLE, naming the tier), and serves again when it is back."""
    paths = models["llama"]
    services = Cluster(paths["draft"], paths["target"])
    services._start_draft(0)
    services._start_target(0)
    # a "pod" at another IP, same port, whose model has a 12-word vocabulary
    foreign = tiny.build_model(tmp_path / "foreign", tiny.word_tokenizer(12), "llama", seed=3)
    foreign_server, _, _ = target_server.start(TargetConfig(model=str(foreign), dtype="float64",
                                                            host="127.0.0.2", port=services.target_port))
    api.put(NS, "d", "draft-svc", [("127.0.0.1", True)])
    api.put(NS, "t", "target-svc", [("127.0.0.1", True)])
    monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig", namespace="default")))
    coordinator = None
    try:
        coordinator = Coordinator("", "", discovery="kubernetes", namespace=NS, draft_service="draft-svc",
                                  target_service="target-svc", draft_port=services.draft_port,
                                  target_port=services.target_port, target_retry_s=0.5)
        first = coordinator.complete(prompt="def f(x):", max_new_tokens=8, ignore_eos=True)
        assert len(first.token_ids) == 8 and first.stats.draft_tokens > 0
        good, foreign_address = f"127.0.0.1:{services.target_port}", f"127.0.0.2:{services.target_port}"
        api.put(NS, "t", "target-svc", [("127.0.0.1", True), ("127.0.0.2", True)])
        wait_until(lambda: coordinator.replicas("target") == {good: "ready", foreign_address: "refused"})
        assert "different tokenizers" in coordinator.describe_replicas("target")
        sids = [coordinator.complete(prompt=f"{i}", max_new_tokens=2).session_id for i in range(8)]
        assert {coordinator.record(s).target.address for s in sids} == {good}  # never the refused one
        api.put(NS, "t", "target-svc", [("127.0.0.1", False), ("127.0.0.2", True)])
        wait_until(lambda: coordinator.replicas("target") == {foreign_address: "refused"})
        with pytest.raises(grpc.RpcError) as info:
            coordinator.complete(prompt="def f(x):", max_new_tokens=8, ignore_eos=True)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no target replica is usable" in info.value.details()
        api.put(NS, "t", "target-svc", [("127.0.0.1", True), ("127.0.0.2", True)])
        wait_until(lambda: coordinator.replicas("target").get(good) == "ready")
        again = coordinator.complete(prompt="def f(x):", max_new_tokens=8, ignore_eos=True)
        assert list(again.token_ids) == list(first.token_ids)
    finally:
        if coordinator is not None:
            coordinator.stop()
        services.draft.stop(None).wait()
        services.target.stop(None).wait()
        foreign_server.stop(None).wait()
        services.loop.close()


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
