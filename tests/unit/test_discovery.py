"""Replica discovery: static lists, and Kubernetes EndpointSlices watched through a local fake API.

Here the unit tests; the other tiers' are in tests/service/test_discovery.py and
tests/e2e/test_discovery.py.
"""

from __future__ import annotations

import pytest

from coordinator.sessions.discovery import DiscoveryError, from_config, parse_addresses, ready_addresses
from specdec.config import CoordinatorConfig


def test_static_lists():
    assert parse_addresses("a:1", "--draft") == {"a:1"}
    assert parse_addresses(" a:1, b:2 ,,a:1", "--draft") == {"a:1", "b:2"}
    with pytest.raises(DiscoveryError, match="--target lists no address"):
        parse_addresses(" , ", "--target")
    with pytest.raises(DiscoveryError, match="not host:port"):
        parse_addresses("a:1,b", "--draft")
    with pytest.raises(DiscoveryError, match="needs --draft-service and --target-service"):
        from_config(CoordinatorConfig(discovery="kubernetes"))


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
