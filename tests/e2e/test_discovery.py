"""Replica discovery: static lists, and Kubernetes EndpointSlices watched through a local fake API.

Here the e2e tests; the other tiers' are in tests/unit/test_discovery.py and
tests/service/test_discovery.py.
"""

from __future__ import annotations

import grpc
import pytest

from specdec_cli import tiny
from specdec.config import TargetConfig
from target_service import server as target_server
from tests.cluster import Cluster
from tests.procs import Coordinator
from tests.service.test_discovery import NS, api, wait_until


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
