"""The Helm chart (helm/specdec): rendered offline with several value sets through Helm's own
Go library (helm-python-sdk), linted, schema-checked, every manifest validated against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict), checkov run once over everything,
and the content that matters asserted.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.process

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

# Custom resources are not in kubernetes-validate's schemas: each gets a minimal schema of
# the fields the chart sets and their operators require.
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["metadata", "spec"],
        "properties": {"spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"],
                                   "properties": {"name": {"type": "string", "minLength": 1}}},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"],
                    "properties": {"type": {"const": "prometheus"},
                                   "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                   "metadata": {"type": "object",
                                                "required": ["serverAddress", "query", "threshold"],
                                                "additionalProperties": {"type": "string"}}}}},
            }, "additionalProperties": False}},
    },
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["metadata", "spec"],
        "properties": {"spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "namespaceSelector": {"type": "object"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"],
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}},
                    "additionalProperties": False}},
            }, "additionalProperties": False}},
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


@pytest.fixture(scope="module")
def manifest_dir(rendered, tmp_path_factory) -> Path:
    """The rendered manifests on disk, one folder per value set (for checkov)."""
    root = tmp_path_factory.mktemp("manifests")
    for name, r in rendered.items():
        for path, text in r.files.items():
            if path.endswith(".yaml") and text.strip():
                target = root / name / Path(path).name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    return root


# ---- lint, schema, validation -----------------------------------------------------------------

@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_is_clean(name):
    report = helm.lint(CHART, copy.deepcopy(VALUE_SETS[name]), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{K8S_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values, where", [
    ({"target": {"replicaCount": "four"}}, "/target/replicaCount"),
    ({"coordinator": {"replicas": 3}}, "replicas"),
    ({"draft": {"image": {"tag": "latest"}}}, "/draft/image/tag"),
    ({"draft": {"service": {"type": "LoadBalancer"}}}, "/draft/service"),
    ({"target": {"autoscaling": {"keda": {"enabled": True}}}}, "/target/autoscaling/enabled"),
    ({"redis": {"external": {"url": "redis://elsewhere:6379/0"}}}, "/redis/external/url"),
    ({"redis": {"enabled": False, "external": {"url": "redis://:secret@elsewhere:6379/0"}}}, "/redis/external/url"),
    ({"redis": {"autoscaling": {"enabled": True}}}, "/redis/autoscaling/enabled"),
    ({"tls": {"internal": {"enabled": True}}}, "/tls/internal/serverSecret"),
    ({"apiKey": {"enabled": True}}, "/apiKey/existingSecret"),
    ({"target": {"model": {"dtype": "int4"}}}, "/target/model/dtype"),
    ({"draft": {"resources": {"limits": {"cpu": "lots"}}}}, "/draft/resources/limits/cpu"),
    ({"draft": {"model": {"backend": "onnx"}}}, "/draft/model/backend"),
    ({"target": {"model": {"threads": -1}}}, "/target/model/threads"),
    ({"target": {"model": {"kvCacheMemoryFraction": 1.5}}}, "/target/model/kvCacheMemoryFraction"),
    ({"draft": {"model": {"kvCacheMemoryFraction": "half"}}}, "/draft/model/kvCacheMemoryFraction"),
    ({"target": {"model": {"kvCacheType": "q4_0"}}}, "/target/model/kvCacheType"),
    ({"draft": {"kvChunks": {"chunkTokens": 0}}}, "/draft/kvChunks/chunkTokens"),
    ({"target": {"kvChunks": {"cache": True}}}, "/target/kvChunks"),
    ({"redis": {"maxmemory": "lots"}}, "/redis/maxmemory"),
    ({"coordinator": {"http": {"readinessProbe": "yes"}}}, "/coordinator/http/readinessProbe"),
    ({"coordinator": {"http": {"ingress": {"enabled": True, "hosts": []}}}}, "/coordinator/http/ingress/hosts"),
    ({"coordinator": {"http": {"ingress": {"hosts": [{"host": "a.example.com", "paths": [
        {"path": "/", "pathType": "Regex"}]}]}}}}, "/coordinator/http/ingress/hosts/0/paths/0/pathType"),
    ({"coordinator": {"http": {"ingress": {"tls": [{"secret": "x"}]}}}}, "/coordinator/http/ingress/tls/0"),
    ({"grafana": {"dashboard": {"label": "grafana dashboard"}}}, "/grafana/dashboard/label"),
    ({"grafana": {"dashboard": {"labelValue": 1}}}, "/grafana/dashboard/labelValue"),
])
def test_schema_rejects_bad_values(chart, values, where):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(info.value)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_manifests_are_valid_kubernetes_objects(rendered, name):
    checked = 0
    for path, doc in rendered[name].docs:
        crd_schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if crd_schema is not None:
            jsonschema.validate(doc, crd_schema)
        else:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {path}: {doc['kind']} {doc['metadata']['name']}: {exc.message} "
                            f"at {'/'.join(map(str, exc.path))}")
        assert doc["metadata"]["namespace"] == NAMESPACE, path
        checked += 1
    assert checked >= 10


def test_template_files_are_named_kind_component(rendered):
    for r in rendered.values():
        for path, doc in r.docs:
            stem = Path(path).stem
            kind = {"HorizontalPodAutoscaler": "hpa", "PodDisruptionBudget": "poddisruptionbudget"}.get(
                doc["kind"], doc["kind"].lower())
            assert stem == f"{kind}-{component_of(doc)}", path
            assert doc["metadata"]["name"] == f"{FULL}-{component_of(doc)}", path


# ---- checkov -----------------------------------------------------------------------------------

EXPECTED_SKIPS = {
    "CKV_K8S_43": "digest",      # images pinned by tag; the digest depends on the registry
    "CKV_K8S_35": "Secret",      # HF_TOKEN / REDIS_PASSWORD are env vars by contract
    "CKV_K8S_38": "EndpointSlices",  # the coordinator needs its token to watch EndpointSlices
}


def test_checkov_passes_with_only_the_stated_skips(manifest_dir):
    checkov = shutil.which("checkov", path=str(Path(sys.executable).parent)) or shutil.which("checkov")
    assert checkov, "checkov (dev extra) is not installed"
    proc = subprocess.run([checkov, "--directory", str(manifest_dir), "--framework", "kubernetes",
                           "--output", "json", "--compact", "--skip-download"],
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    results = report["results"]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in results["failed_checks"]]
    assert failed == [], failed
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 500
    skipped = results["skipped_checks"]
    for check in skipped:
        assert check["check_id"] in EXPECTED_SKIPS, check["check_id"]
        assert EXPECTED_SKIPS[check["check_id"]] in check["check_result"]["suppress_comment"]
    assert {c["check_id"] for c in skipped} == set(EXPECTED_SKIPS)


# ---- content -----------------------------------------------------------------------------------

def test_every_pod_is_locked_down(rendered):
    for name, r in rendered.items():
        for workload in r.objects("Deployment") + r.objects("StatefulSet"):
            pod = workload["spec"]["template"]["spec"]
            where = f"{name}: {workload['metadata']['name']}"
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert pod["securityContext"]["runAsUser"] == 10001, where
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            c = container(workload)
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and \
                {"cpu", "memory"} <= set(c["resources"]["limits"]), where
            repo, _, tag = c["image"].rpartition(":")
            assert repo and tag and tag != "latest", where
            assert c["imagePullPolicy"] in ("Always", "IfNotPresent"), where
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, where
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert probe in c, f"{where}: {probe}"
            if component_of(workload) != "coordinator":
                assert pod["automountServiceAccountToken"] is False, where


def test_model_tiers_have_grpc_probes_and_a_long_startup(rendered):
    r = rendered["defaults"]
    for tier, port, service in (("draft", 50052, "specdec.v1.DraftService"),
                                ("target", 50053, "specdec.v1.TargetService"),
                                ("coordinator", 50051, "specdec.v1.Coordinator")):
        c = container(r.one("Deployment", tier))
        assert c["livenessProbe"]["grpc"] == {"port": port}
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}
        assert c["startupProbe"]["grpc"] == {"port": port}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": port, "metrics": 9090, **({"http": 8000} if tier == "coordinator" else {})}
        assert f"--port={port}" in c["args"] and "--metrics-port=9090" in c["args"]
        assert "--host=0.0.0.0" in c["args"]
    startup = container(r.one("Deployment", "target"))["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800


def test_draft_and_target_services_are_headless(rendered):
    r = rendered["defaults"]
    for tier in ("draft", "target"):
        svc = r.one("Service", tier)
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == selector_labels(tier)
    coordinator = r.one("Service", "coordinator")
    assert coordinator["spec"]["type"] == "ClusterIP" and "clusterIP" not in coordinator["spec"]


def test_coordinator_discovers_tiers_with_a_minimal_role(rendered):
    r = rendered["defaults"]
    deployment = r.one("Deployment", "coordinator")
    args = container(deployment)["args"]
    assert args[:2] == ["serve", "coordinator"]
    for flag in ("--discovery=kubernetes", f"--draft-service={FULL}-draft", f"--target-service={FULL}-target",
                 f"--namespace={NAMESPACE}", "--draft-port=50052", "--target-port=50053"):
        assert flag in args
    role = r.one("Role", "coordinator")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = r.one("RoleBinding", "coordinator")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert r.one("ServiceAccount", "coordinator")["metadata"]["name"] == account


def test_network_policies_admit_only_the_coordinator(rendered):
    r = rendered["defaults"]
    for tier, port in (("draft", 50052), ("target", 50053), ("redis", 6379)):
        policy = r.one("NetworkPolicy", tier)
        assert policy["spec"]["podSelector"]["matchLabels"] == selector_labels(tier)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        api_rule = policy["spec"]["ingress"][0]
        assert api_rule["from"] == [{"podSelector": {"matchLabels": selector_labels("coordinator")}}]
        assert api_rule["ports"] == [{"port": port, "protocol": "TCP"}]
    draft_rules = r.one("NetworkPolicy", "draft")["spec"]["ingress"]
    assert draft_rules[1] == {"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": 9090, "protocol": "TCP"}]}
    open_api = r.one("NetworkPolicy", "coordinator")["spec"]["ingress"][0]
    assert "from" not in open_api and open_api["ports"] == [{"port": 50051, "protocol": "TCP"},
                                                            {"port": 8000, "protocol": "TCP"}]
    restricted = rendered["tls-apikey"].one("NetworkPolicy", "coordinator")["spec"]["ingress"][0]
    assert restricted["from"] == [{"namespaceSelector": {"matchLabels": {"gateway": "true"}}}]


def test_default_redis_is_in_chart_with_a_generated_password(rendered):
    r = rendered["defaults"]
    sts = r.one("StatefulSet", "redis")
    redis = container(sts)
    assert redis["image"].startswith("redis:") and "--requirepass" in redis["args"]
    secret = r.one("Secret", "redis")
    assert len(secret["data"]["redis-password"]) >= 40  # 32 random characters, base64
    env = env_of(container(r.one("Deployment", "coordinator")))
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis", "key": "redis-password"}
    assert env["SPECDEC_COORDINATOR_SESSION_STORE"]["value"] == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
    names = [e["name"] for e in container(r.one("Deployment", "coordinator"))["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("SPECDEC_COORDINATOR_SESSION_STORE")


def test_external_redis_url_takes_the_password_from_its_secret(rendered):
    r = rendered["external-redis"]
    assert r.maybe("StatefulSet", "redis") is None and r.maybe("Service", "redis") is None
    assert r.maybe("Secret", "redis") is None and r.maybe("NetworkPolicy", "redis") is None
    c = container(r.one("Deployment", "coordinator"))
    env = env_of(c)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ext-redis", "key": "password"}
    assert env["SPECDEC_COORDINATOR_SESSION_STORE"]["value"] == \
        "rediss://:$(REDIS_PASSWORD)@redis.db.internal:6380/2"
    names = [e["name"] for e in c["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("SPECDEC_COORDINATOR_SESSION_STORE")


def test_the_http_api_is_on_the_coordinators_pods_and_service(rendered):
    """coordinator.http.port: the flag, a named container port, a Service port (appProtocol
    http); 0 leaves all three out and passes --http-port=0 (off)."""
    r = rendered["defaults"]
    c = container(r.one("Deployment", "coordinator"))
    assert "--http-port=8000" in c["args"]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    service_ports = r.one("Service", "coordinator")["spec"]["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
            "appProtocol": "http"} in service_ports
    off = rendered["memory-store-no-metrics"]
    c = container(off.one("Deployment", "coordinator"))
    assert "--http-port=0" in c["args"] and all(p["name"] != "http" for p in c["ports"])
    assert all(p["name"] != "http" for p in off.one("Service", "coordinator")["spec"]["ports"])


def test_the_http_readiness_probe_is_an_http_get_on_the_http_port(rendered, chart):
    """coordinator.http.readinessProbe: readiness becomes GET /health on http.port (HTTPS with
    tls.public, no key needed), with the readiness timings; startup and liveness stay gRPC."""
    c = container(rendered["http-ingress"].one("Deployment", "coordinator"))
    assert c["readinessProbe"] == {"httpGet": {"path": "/health", "port": 8080, "scheme": "HTTPS"},
                                   "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5}
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][:2] == ["specdec-healthcheck", "127.0.0.1:50051"], probe
    plain = chart.render({"coordinator": {"http": {"readinessProbe": True},
                                          "probes": {"readiness": {"periodSeconds": 7}}}},
                         name=RELEASE, namespace=NAMESPACE, is_install=True)
    (deployment,) = [d for d in yaml.safe_load_all(plain["specdec/templates/deployment-coordinator.yaml"]) if d]
    c = container(deployment)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000, "scheme": "HTTP"}
    assert c["readinessProbe"]["periodSeconds"] == 7 and "grpc" not in c["readinessProbe"]
    assert c["livenessProbe"]["grpc"] == {"port": 50051} and c["startupProbe"]["grpc"] == {"port": 50051}
    for name, r in rendered.items():  # off by default: every other value set keeps the gRPC readiness probe
        if name != "http-ingress":
            assert "httpGet" not in container(r.one("Deployment", "coordinator"))["readinessProbe"], name
    for tier in ("draft", "target"):
        assert "httpGet" not in container(rendered["http-ingress"].one("Deployment", tier))["readinessProbe"]


def test_the_ingress_routes_to_the_coordinators_http_port(rendered, chart):
    r = rendered["http-ingress"]
    ingress = r.one("Ingress", "coordinator")
    assert ingress["apiVersion"] == "networking.k8s.io/v1" and ingress["metadata"]["name"] == f"{FULL}-coordinator"
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/backend-protocol": "HTTPS"}
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"secretName": "api-ingress-tls", "hosts": ["api.example.com"]}]
    backend = {"service": {"name": f"{FULL}-coordinator", "port": {"name": "http"}}}
    assert spec["rules"] == [{"host": "api.example.com", "http": {"paths": [
        {"path": "/v1", "pathType": "Prefix", "backend": backend},
        {"path": "/health", "pathType": "Exact", "backend": backend}]}}]
    # the backend: the coordinator Service's port "http", which is http.port, and speaks TLS here
    service = r.one("Service", "coordinator")
    assert {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP",
            "appProtocol": "https"} in service["spec"]["ports"]
    # the NetworkPolicy admits the HTTP port from the same peers as the gRPC port (the controller's namespace)
    api_rule = r.one("NetworkPolicy", "coordinator")["spec"]["ingress"][0]
    assert api_rule["ports"] == [{"port": 50051, "protocol": "TCP"}, {"port": 8080, "protocol": "TCP"}]
    assert api_rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    assert "https://api.example.com/v1" in r.notes
    for name, other in rendered.items():  # off by default
        if name != "http-ingress":
            assert other.objects("Ingress") == [], name
    # the smallest one: any host, pathType Prefix, no class, annotations or TLS
    bare = chart.render({"coordinator": {"http": {"ingress": {"enabled": True, "hosts": [{"host": "", "paths": [{"path": "/"}]}]}}}},
                        name=RELEASE, namespace=NAMESPACE, is_install=True)
    (ingress,) = [d for d in yaml.safe_load_all(bare["specdec/templates/ingress-coordinator.yaml"]) if d]
    assert "annotations" not in ingress["metadata"]
    assert ingress["spec"] == {"rules": [{"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
        "service": {"name": f"{FULL}-coordinator", "port": {"name": "http"}}}}]}}]}
    kubernetes_validate.validate(ingress, K8S_VERSION, strict=True)


@pytest.mark.parametrize("http, message", [
    ({"port": 0, "readinessProbe": True}, "coordinator.http.readinessProbe needs the HTTP API"),
    ({"port": 0, "ingress": {"enabled": True}}, "coordinator.http.ingress.enabled needs the HTTP API"),
])
def test_the_http_probe_or_ingress_without_the_http_api_fail_to_render(chart, http, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render({"coordinator": {"http": http}}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_kv_chunks_go_to_the_charts_redis(rendered):
    """kvChunks.store: each tier gets --kv-store as the session store's URL (its password from the
    same Secret), Redis admits it, and Redis evicts the keys nearest expiry past its maxmemory."""
    r = rendered["kv-store"]
    for tier, ttl, prefix in (("draft", 3600, 268435456), ("target", 600, 0)):
        c = container(r.one("Deployment", tier))
        env = env_of(c)
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-redis", "key": "redis-password"}
        assert env[f"SPECDEC_{tier.upper()}_KV_STORE"]["value"] == f"redis://:$(REDIS_PASSWORD)@{FULL}-redis:6379/0"
        names = [e["name"] for e in c["env"]]
        assert names.index("REDIS_PASSWORD") < names.index(f"SPECDEC_{tier.upper()}_KV_STORE")
        assert f"--kv-store-ttl-s={ttl}" in c["args"] and f"--prefix-cache-bytes={prefix}" in c["args"]
        assert "--kv-chunk-tokens=256" in c["args"]
    sources = r.one("NetworkPolicy", "redis")["spec"]["ingress"][0]["from"]
    assert [s["podSelector"]["matchLabels"] for s in sources] == [
        selector_labels("coordinator"), selector_labels("draft"), selector_labels("target")]
    args = container(r.one("StatefulSet", "redis"))["args"]
    assert args[args.index("--maxmemory") + 1] == "768mb"
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-ttl"
    plain = rendered["defaults"]
    for tier in ("draft", "target"):
        c = container(plain.one("Deployment", tier))
        assert f"SPECDEC_{tier.upper()}_KV_STORE" not in env_of(c) and "REDIS_PASSWORD" not in env_of(c)
        assert not any(a.startswith("--kv-store-ttl-s") for a in c["args"])
    assert len(plain.one("NetworkPolicy", "redis")["spec"]["ingress"][0]["from"]) == 1


def test_kv_chunks_without_a_redis_fail_to_render(chart):
    with pytest.raises(Exception, match="target.kvChunks.store needs a Redis"):
        chart.render({"redis": {"enabled": False}, "target": {"kvChunks": {"store": True}}},
                     name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_memory_store_and_metrics_off(rendered):
    r = rendered["memory-store-no-metrics"]
    c = container(r.one("Deployment", "coordinator"))
    assert env_of(c)["SPECDEC_COORDINATOR_SESSION_STORE"]["value"] == "memory"
    assert "REDIS_PASSWORD" not in env_of(c) and "--metrics-port=0" in c["args"]
    assert [p["name"] for p in c["ports"]] == ["grpc"]
    assert [p["name"] for p in r.one("Service", "target")["spec"]["ports"]] == ["grpc"]
    assert len(r.one("NetworkPolicy", "target")["spec"]["ingress"]) == 1


def test_gpu_values_put_target_and_draft_on_their_pools(rendered):
    r = rendered["gpu"]
    target = r.one("Deployment", "target")
    pod = target["spec"]["template"]["spec"]
    c = container(target)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"pool": "gpu-large"} and pod["tolerations"] == [GPU_TOLERATION]
    assert c["image"] == "specdec:0.1.0-cuda" and "--device=cuda" in c["args"] and "--dtype=float16" in c["args"]
    assert target["spec"]["replicas"] == 4
    assert container(r.one("Deployment", "draft"))["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert r.one("Deployment", "draft")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu-small"}
    coordinator = r.one("Deployment", "coordinator")
    assert "nvidia.com/gpu" not in container(coordinator)["resources"]["limits"]
    assert "nodeSelector" not in coordinator["spec"]["template"]["spec"]
    defaults = rendered["defaults"]
    assert "nvidia.com/gpu" not in container(defaults.one("Deployment", "target"))["resources"]["limits"]


def test_the_kv_pool_takes_a_fraction_of_the_gpus_memory_only_where_set(rendered, chart):
    gpu = rendered["gpu"]
    for tier, fraction in (("draft", "0.25"), ("target", "0.6")):
        args = container(gpu.one("Deployment", tier))["args"]
        assert f"--kv-cache-memory-fraction={fraction}" in args and any(a.startswith("--kv-cache-bytes=") for a in args)
    for name, r in rendered.items():  # unset (0) by default: the flag is not passed
        for deployment in r.objects("Deployment"):
            if name != "gpu":
                assert not any(a.startswith("--kv-cache-memory-fraction") for a in container(deployment)["args"])
    for model in ({"kvCacheMemoryFraction": 0.5}, {"kvCacheMemoryFraction": 0.5, "device": "cuda", "backend": "torch"}):
        with pytest.raises(Exception, match="target.model.kvCacheMemoryFraction sizes the graph backend's K/V pool"):
            chart.render({"target": {"model": model}}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_gguf_values_serve_the_files_through_llama_cpp(rendered):
    r = rendered["gguf"]
    draft, target = (container(r.one("Deployment", tier))["args"] for tier in ("draft", "target"))
    assert {"--model=/models/draft-q4_k_m.gguf", "--backend=llama.cpp", "--threads=2",
            "--kv-cache-type=q8_0"} <= set(draft)
    assert {"--model=/models/target-q4_k_m.gguf", "--backend=llama.cpp", "--threads=4",
            "--kv-cache-type=f16"} <= set(target)
    defaults = container(rendered["defaults"].one("Deployment", "target"))["args"]
    assert {"--backend=auto", "--threads=0"} <= set(defaults)


def test_a_disabled_tier_renders_nothing(rendered):
    r = rendered["draft-disabled"]
    assert [doc["kind"] for _, doc in r.docs if component_of(doc) == "draft"] == []
    assert r.maybe("Deployment", "target") is not None
    # the coordinator still watches the (absent) draft Service: every round is target-only
    assert f"--draft-service={FULL}-draft" in container(r.one("Deployment", "coordinator"))["args"]


def test_autoscaling_renders_hpas_and_leaves_replicas_alone(rendered):
    r = rendered["autoscaling"]
    for tier in TIERS:
        hpa = r.one("HorizontalPodAutoscaler", tier)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-{tier}"}
        assert "replicas" not in r.one("Deployment", tier)["spec"]
    assert r.objects("ScaledObject") == []
    assert rendered["defaults"].objects("HorizontalPodAutoscaler") == []


def test_keda_renders_scaled_objects_instead_of_hpas(rendered):
    r = rendered["keda"]
    assert r.objects("HorizontalPodAutoscaler") == []
    for tier in TIERS:
        scaled = r.one("ScaledObject", tier)
        assert scaled["spec"]["scaleTargetRef"]["name"] == f"{FULL}-{tier}"
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
        assert "replicas" not in r.one("Deployment", tier)["spec"]
        monitor = r.one("ServiceMonitor", tier)
        assert monitor["spec"]["selector"]["matchLabels"] == selector_labels(tier)
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_the_grafana_dashboard_is_a_configmap_for_the_sidecar(rendered, chart):
    dashboard = json.loads((CHART / "dashboards" / "specdec.json").read_text())
    config_map = rendered["keda"].one("ConfigMap", "dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "specdec"}
    assert json.loads(config_map["data"]["specdec.json"]) == dashboard  # the file, whole
    assert rendered["defaults"].maybe("ConfigMap", "dashboard") is None  # off by default
    other = chart.render({"grafana": {"dashboard": {"enabled": True, "label": "example.com/dashboard",
                                                    "labelValue": "specdec", "namespace": "monitoring"}}},
                         name=RELEASE, namespace=NAMESPACE, is_install=True)
    moved = yaml.safe_load(other["specdec/templates/configmap-dashboard.yaml"])
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["labels"]["example.com/dashboard"] == "specdec"
    assert "grafana_dashboard" not in moved["metadata"]["labels"] and "annotations" not in moved["metadata"]


def test_tls_and_api_key(rendered):
    r = rendered["tls-apikey"]
    coordinator = r.one("Deployment", "coordinator")
    c = container(coordinator)
    for flag in ("--api-key-file=/etc/specdec/api-key/api-key",
                 "--tls-cert-file=/etc/specdec/tls-public/tls.crt", "--tls-key-file=/etc/specdec/tls-public/tls.key",
                 "--upstream-ca-file=/etc/specdec/tls-internal/ca.crt",
                 "--upstream-cert-file=/etc/specdec/tls-internal/tls.crt",
                 "--upstream-key-file=/etc/specdec/tls-internal/tls.key",
                 "--upstream-server-name=specdec-internal"):
        assert flag in c["args"]
    volumes = {v["name"]: v for v in coordinator["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-key"]["secret"]["secretName"] == "specdec-api-key"
    assert volumes["tls-public"]["secret"]["secretName"] == "api-tls"
    assert volumes["tls-internal"]["secret"]["secretName"] == "coordinator-client-tls"
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["specdec-healthcheck", "127.0.0.1:50051", "--service=specdec.v1.Coordinator"]
    assert "--api-key-file=/etc/specdec/api-key/api-key" in probe and "--server-name=api.example.com" in probe
    for tier in ("draft", "target"):
        deployment = r.one("Deployment", tier)
        tc = container(deployment)
        for flag in ("--tls-cert-file=/etc/specdec/tls-internal/tls.crt",
                     "--tls-key-file=/etc/specdec/tls-internal/tls.key",
                     "--tls-client-ca-file=/etc/specdec/tls-internal/ca.crt"):
            assert flag in tc["args"]
        tier_volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert tier_volumes["tls-internal"]["secret"]["secretName"] == "tiers-tls"
        assert tier_volumes["models"]["persistentVolumeClaim"] == {"claimName": "specdec-models", "readOnly": True}
        assert "--server-name=specdec-internal" in tc["livenessProbe"]["exec"]["command"]
        assert env_of(tc)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    target = r.one("Deployment", "target")
    assert "--model=/models/qwen2.5-coder-1.5b-instruct" in container(target)["args"]
    cache = {v["name"]: v for v in target["spec"]["template"]["spec"]["volumes"]}["cache"]
    assert cache == {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    assert "Bearer" in r.notes and "-cacert" in r.notes


def test_notes_tell_how_to_call_the_api(rendered, chart):
    notes = rendered["defaults"].notes
    assert f"port-forward svc/{FULL}-coordinator 50051:50051" in notes
    assert "grpcurl -plaintext localhost:50051 list" in notes
    assert "specdec.v1.Coordinator/Generate" in notes
    assert "WARNING" not in notes
    shared_nothing = chart.render({"redis": {"enabled": False}}, name=RELEASE, namespace=NAMESPACE)
    assert "WARNING: several coordinator pods with the in-memory session store" in shared_nothing["specdec/templates/NOTES.txt"]


# ---- the chart's commands against the real CLI -------------------------------------------------

def unknown_flags(argv: list[str]) -> list[str]:
    """Flags in argv that `specdec`'s parser does not know. Known flags must hold valid values:
    argparse checks the choices, and a `serve` command's values must build its config."""
    from specdec_cli.main import build_parser
    from specdec.config import CoordinatorConfig, DraftConfig, TargetConfig, from_sources

    try:
        namespace, extras = build_parser().parse_known_args(argv)
        if namespace.command == "serve":
            config = {"draft": DraftConfig, "target": TargetConfig, "coordinator": CoordinatorConfig}
            from_sources(config[namespace.service], namespace.service, vars(namespace), env={})
    except SystemExit as exc:
        pytest.fail(f"specdec rejects {argv}: {exc}")
    return [arg.split("=", 1)[0] for arg in extras if arg.startswith("-")]


def check_against_cli(commands: dict[str, list[str]]) -> None:
    """Every flag the chart or compose passes is one the CLI knows."""
    for where, argv in commands.items():
        unknown = sorted(set(unknown_flags(argv)))
        assert not unknown, f"{where}: the CLI has no {unknown}"


@pytest.mark.parametrize("name", ["defaults", "tls-apikey", "gpu"])
def test_chart_commands_parse_with_the_cli(rendered, name):
    commands = {}
    for deployment in rendered[name].objects("Deployment"):
        c = container(deployment)
        assert c["args"][:2] == ["serve", component_of(deployment)]
        commands[deployment["metadata"]["name"]] = c["args"]
    check_against_cli(commands)


# ---- values.yaml and its schema ---------------------------------------------------------------

def _value_paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    if isinstance(node, dict):
        for key, value in node.items():
            paths.append(prefix + (key,))
            if not (prefix and prefix[-1] in ("matchLabels", "labels", "annotations", "nodeSelector")):
                paths += _value_paths(value, prefix + (key,))
    return paths


def test_every_value_has_a_comment():
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^(\s*)([A-Za-z0-9_.\-/\"]+):")
    for number, line in enumerate(lines):
        match = key.match(line)
        if not match:
            continue
        previous = lines[number - 1].strip() if number else ""
        parent_is_free_map = False
        indent = len(match.group(1))
        for earlier in reversed(lines[:number]):
            m = key.match(earlier)
            if m and len(m.group(1)) < indent:
                parent_is_free_map = m.group(2) in ("matchLabels",)
                break
        assert previous.startswith("#") or parent_is_free_map, f"values.yaml:{number + 1}: {line.strip()} has no comment"


def test_schema_model_choices_are_the_flags_choices():
    """The chart's model enums restate the service flags' choices: they must not drift apart."""
    from specdec.config import DTYPES, choices_of
    from specdec.types import Backend, KVCacheType

    model = json.loads((CHART / "values.schema.json").read_text())["definitions"]["model"]["properties"]
    assert model["backend"]["enum"] == list(choices_of(Backend))
    assert model["kvCacheType"]["enum"] == list(choices_of(KVCacheType))
    assert model["dtype"]["enum"] == list(DTYPES)


def test_schema_covers_every_value(chart):
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def resolve(node: dict) -> dict:
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def properties(node: dict) -> dict:
        node = resolve(node)
        props = dict(node.get("properties", {}))
        for part in node.get("allOf", []):
            props.update(properties(part))
        return props

    for path in _value_paths(defaults):
        node = schema
        for part in path:
            props = properties(node)
            if part in props:
                node = props[part]
                described = node.get("description") or resolve(node).get("description")
                assert described, f"{'.'.join(path)}: no description in values.schema.json"
            else:  # a free-form map: its values are checked by additionalProperties
                extra = resolve(node).get("additionalProperties")
                assert extra is not False, f"{'.'.join(path)} is not in values.schema.json"
                node = extra if isinstance(extra, dict) else {}
    tiers = [set(defaults[tier]) for tier in ("coordinator", "draft", "target", "redis")]
    shared = {"enabled", "image", "replicaCount", "resources", "nodeSelector", "tolerations", "affinity",
              "autoscaling", "service", "podDisruptionBudget", "extraArgs", "env"}
    assert all(shared <= keys for keys in tiers)
    chart.validate_schema(defaults)


def test_the_target_serves_heads_only_where_set(rendered, chart):
    for r in rendered.values():  # empty by default: no flag
        for deployment in r.objects("Deployment"):
            assert not any(a.startswith("--heads") for a in container(deployment)["args"])
    r = Rendered(chart.render({"target": {"heads": "/models/heads/qwen-1"}}, name=RELEASE, namespace=NAMESPACE,
                              is_install=True))
    assert "--heads=/models/heads/qwen-1" in container(r.one("Deployment", "target"))["args"]
    assert not any(a.startswith("--heads") for a in container(r.one("Deployment", "draft"))["args"])
