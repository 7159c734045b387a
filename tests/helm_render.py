"""The Helm chart's tests' shared part (tests/process/test_helm.py, tests/process/test_helm_content.py): the value
sets, the chart rendered offline with each through Helm's own Go library (helm-python-sdk), and
accessors for the rendered objects. Importing it skips the importing module where the dev extra's
deploy tools are missing.

The fixtures `chart` and `rendered` are module-scoped: a test module makes them its own with
`chart, rendered = helm_render.chart, helm_render.rendered`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the dev extra")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "specdec"
RELEASE, NAMESPACE = "demo", "inference"
FULL = f"{RELEASE}-specdec"
# The newest Kubernetes minor whose schemas kubernetes-validate 1.37 bundles.
K8S_VERSION = "1.37.0"
TIERS = ("coordinator", "draft", "target")

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": {
        "draft": {"image": {"tag": "0.1.0-cuda"}, "model": {"device": "cuda", "backend": "graph",
                                                            "kvCacheMemoryFraction": 0.25},
                  "resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
                  "nodeSelector": {"pool": "gpu-small"}, "tolerations": [GPU_TOLERATION]},
        "target": {"image": {"tag": "0.1.0-cuda"}, "model": {"device": "cuda", "dtype": "float16",
                                                             "kvCacheMemoryFraction": 0.6},
                   "replicaCount": 4,
                   "resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
                   "nodeSelector": {"pool": "gpu-large"}, "tolerations": [GPU_TOLERATION]},
    },
    "gguf": {
        "draft": {"model": {"name": "/models/draft-q4_k_m.gguf", "backend": "llama.cpp", "threads": 2,
                            "kvCacheType": "q8_0"}},
        "target": {"model": {"name": "/models/target-q4_k_m.gguf", "backend": "llama.cpp", "threads": 4}},
        "modelVolume": {"existingClaim": "specdec-models"},
    },
    "external-redis": {
        "redis": {"enabled": False, "external": {"url": "rediss://redis.db.internal:6380/2",
                                                  "existingSecret": "ext-redis", "key": "password"}},
    },
    "autoscaling": {tier: {"autoscaling": {"enabled": True}} for tier in TIERS},
    "keda": {
        **{tier: {"autoscaling": {"enabled": True, "keda": {"enabled": True}}} for tier in TIERS},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
        "grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "specdec"}}},
    },
    "tls-apikey": {
        "tls": {"internal": {"enabled": True, "serverSecret": "tiers-tls", "clientSecret": "coordinator-client-tls"},
                "public": {"enabled": True, "secretName": "api-tls", "serverName": "api.example.com"}},
        "apiKey": {"enabled": True, "existingSecret": "specdec-api-key"},
        "huggingface": {"tokenSecret": {"name": "hf-token"}},
        "modelVolume": {"existingClaim": "specdec-models"},
        "target": {"model": {"name": "/models/qwen2.5-coder-1.5b-instruct"}, "cache": {"existingClaim": "hf-cache"}},
        "networkPolicy": {"coordinatorIngressFrom": [{"namespaceSelector": {"matchLabels": {"gateway": "true"}}}]},
    },
    "kv-store": {"draft": {"kvChunks": {"store": True}},
                 "target": {"kvChunks": {"store": True, "ttlSeconds": 600, "prefixCacheBytes": 0}}},
    "draft-disabled": {"draft": {"enabled": False}},
    "memory-store-no-metrics": {"redis": {"enabled": False}, "metrics": {"port": 0},
                                "coordinator": {"replicaCount": 1, "http": {"port": 0}}},
    "http-ingress": {
        "tls": {"public": {"enabled": True, "secretName": "api-tls"}},
        "coordinator": {"http": {"port": 8080, "readinessProbe": True, "ingress": {
            "enabled": True, "className": "nginx",
            "annotations": {"nginx.ingress.kubernetes.io/backend-protocol": "HTTPS"},
            "hosts": [{"host": "api.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"},
                                                            {"path": "/health", "pathType": "Exact"}]}],
            "tls": [{"secretName": "api-ingress-tls", "hosts": ["api.example.com"]}]}}},
        "networkPolicy": {"coordinatorIngressFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]},
    },
}


# ---- rendering ---------------------------------------------------------------------------------

class Rendered:
    """One value set rendered: the template files and the objects they hold."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self.docs: list[tuple[str, dict]] = []
        for path, text in files.items():
            if path.endswith(".yaml"):
                self.docs += [(path, doc) for doc in yaml.safe_load_all(text) if doc]

    def objects(self, kind: str) -> list[dict]:
        return [doc for _, doc in self.docs if doc["kind"] == kind]

    def one(self, kind: str, component: str) -> dict:
        found = [d for d in self.objects(kind) if component_of(d) == component]
        assert len(found) == 1, f"{len(found)} {kind} objects for {component}"
        return found[0]

    def maybe(self, kind: str, component: str) -> dict | None:
        found = [d for d in self.objects(kind) if component_of(d) == component]
        return found[0] if found else None

    @property
    def notes(self) -> str:
        return next(text for path, text in self.files.items() if path.endswith("NOTES.txt"))


def component_of(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def selector_labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": component}


@pytest.fixture(scope="module")
def chart():
    loaded = helm.Chart.load(CHART)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, Rendered]:
    """Every value set rendered once."""
    return {name: Rendered(chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE,
                                        is_install=True))
            for name, values in VALUE_SETS.items()}

