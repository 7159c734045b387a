"""The chart with a Redis that has replicas: an external Sentinel or Cluster URL, and
redis.sessionDurability passed to the coordinators; refused where it cannot work."""

from __future__ import annotations

import copy

import pytest

from tests import helm_render
from tests.helm_render import NAMESPACE, RELEASE, container, env_of, helm

chart = helm_render.chart

SENTINEL = {"redis": {"enabled": False, "sessionDurability": "replicas=1,timeout_ms=500",
                      "external": {"url": "redis+sentinel://s-0.redis:26379,s-1.redis:26379/specdec/0",
                                   "existingSecret": "ha-redis", "key": "password"}}}


def _coordinator_env(chart, values) -> dict:
    docs = helm_render.Rendered(chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE,
                                             is_install=True))
    deployment = next(d for d in docs.objects("Deployment") if helm_render.component_of(d) == "coordinator")
    return env_of(container(deployment))


def test_a_sentinel_url_and_durability_reach_the_coordinator(chart):
    env = _coordinator_env(chart, SENTINEL)
    assert env["SPECDEC_COORDINATOR_SESSION_STORE"]["value"] == (
        "redis+sentinel://:$(REDIS_PASSWORD)@s-0.redis:26379,s-1.redis:26379/specdec/0")
    assert env["SPECDEC_COORDINATOR_SESSION_DURABILITY"]["value"] == "replicas=1,timeout_ms=500"
    cluster = {"redis": {"enabled": False, "external": {"url": "redis+cluster://c-0:6379,c-1:6379"}}}
    env = _coordinator_env(chart, cluster)
    assert env["SPECDEC_COORDINATOR_SESSION_STORE"]["value"] == "redis+cluster://c-0:6379,c-1:6379"
    assert "SPECDEC_COORDINATOR_SESSION_DURABILITY" not in env  # none: the default, not spelled out


@pytest.mark.parametrize("values, says", [
    ({"redis": {"sessionDurability": "replicas=0"}}, "/redis/sessionDurability"),
    ({"redis": {"enabled": False, "external": {"url": "redis+sentinel://s:26379"}}}, "/redis/external/url"),
])
def test_bad_ha_values_are_refused(chart, values, says):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert says in str(info.value)


def test_durability_with_the_single_in_chart_redis_is_refused(chart):
    with pytest.raises(Exception, match="needs a Redis with replicas"):
        chart.render({"redis": {"sessionDurability": "replicas=1"}}, name=RELEASE, namespace=NAMESPACE)
