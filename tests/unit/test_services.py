"""Service tier: health, reflection, model info, KV cache bounds, start-up checks.

Here the unit tests; the other tiers' are in tests/service/test_services.py and
tests/e2e/test_services.py.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.server import StartupError, start as start_coordinator
from specdec.config import CoordinatorConfig


def test_coordinator_startup_fails_fast_when_services_are_down():
    config = CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2", port=0)
    with pytest.raises(StartupError) as info:
        asyncio.run(start_coordinator(config, startup_timeout_s=1))
    assert "cannot reach the model services" in str(info.value)
