"""What the Helm chart's rendered manifests say, value set by value set (tests/helm_render.py):
pods locked down, probes, Services, discovery and its role, network policies, Redis (in chart,
external, K/V chunks), the HTTP API, its readiness probe and Ingress, GPUs, GGUF models, disabled
tiers, autoscaling (HPA, KEDA), the Grafana dashboard, TLS and API keys, the NOTES, and the
render-time failures of values that contradict each other. The chart as a whole (lint, schema,
Kubernetes validation, checkov, the CLI) is tested in tests/test_helm.py.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests import helm_render
from tests.helm_render import (CHART, FULL, GPU_TOLERATION, K8S_VERSION, NAMESPACE, RELEASE, TIERS, Rendered,
                               component_of, container, env_of, helm, kubernetes_validate, selector_labels)

pytestmark = pytest.mark.process

chart, rendered = helm_render.chart, helm_render.rendered  # the shared fixtures, for this module's tests


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


def test_notes_show_the_http_api_with_curl_and_where_both_apis_are_in_the_cluster(rendered):
    notes = rendered["defaults"].notes
    assert "OpenAI-compatible HTTP API" in notes and "port 8000" in notes
    assert f"port-forward svc/{FULL}-coordinator 8000:8000" in notes
    assert "curl -s http://localhost:8000/v1/models" in notes
    assert "curl -s http://localhost:8000/v1/chat/completions" in notes
    assert '"model": "Qwen/Qwen2.5-Coder-1.5B-Instruct"' in notes  # the name the API serves by default
    assert f"{FULL}-coordinator.{NAMESPACE}.svc:50051" in notes  # gRPC inside the cluster
    assert f"http://{FULL}-coordinator.{NAMESPACE}.svc:8000/v1" in notes
    secured = rendered["tls-apikey"].notes  # HTTPS with the CA and the key, on the served name
    assert "curl -s --cacert ca.crt --connect-to api.example.com:8000:localhost:8000" in secured
    assert "https://api.example.com:8000/v1/models" in secured and "Bearer $SPECDEC_API_KEY" in secured
    assert '"model": "qwen2.5-coder-1.5b-instruct"' in secured  # a directory: its base name
    off = rendered["memory-store-no-metrics"].notes  # coordinator.http.port 0: no HTTP API to mention
    assert "HTTP API" not in off and "curl -s" not in off and ":8000" not in off


def _images(r: Rendered) -> dict[str, tuple[str, str]]:
    """component -> (image, imagePullPolicy) of every workload's container."""
    return {component_of(w): (container(w)["image"], container(w)["imagePullPolicy"])
            for w in r.objects("Deployment") + r.objects("StatefulSet")}


def test_one_image_value_sets_every_specdec_pod_and_pulls_only_if_not_present(rendered, chart):
    assert _images(rendered["defaults"]) == {
        "coordinator": ("specdec:0.1.0", "IfNotPresent"), "draft": ("specdec:0.1.0", "IfNotPresent"),
        "target": ("specdec:0.1.0", "IfNotPresent"), "redis": ("redis:7.4.2-alpine", "IfNotPresent")}
    for image in ("specdec:dev", "registry.example.com:5000/team/specdec:0.2.0",
                  "specdec@sha256:" + "a" * 64):
        r = Rendered(chart.render({"image": image}, name=RELEASE, namespace=NAMESPACE, is_install=True))
        assert _images(r) == {**{tier: (image, "IfNotPresent") for tier in TIERS},
                              "redis": ("redis:7.4.2-alpine", "IfNotPresent")}, image
    # the per-tier keys still work where the one value is empty (a CUDA image for the GPU tiers)
    gpu = _images(rendered["gpu"])
    assert gpu["draft"][0] == gpu["target"][0] == "specdec:0.1.0-cuda" and gpu["coordinator"][0] == "specdec:0.1.0"


@pytest.mark.parametrize("image", ["specdec", "specdec:latest", "registry.example.com:5000/specdec", "spec dec:1"])
def test_schema_rejects_an_image_without_a_pinned_tag(chart, image):
    with pytest.raises(Exception):
        chart.render({"image": image}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_the_target_serves_heads_only_where_set(rendered, chart):
    for r in rendered.values():  # empty by default: no flag
        for deployment in r.objects("Deployment"):
            assert not any(a.startswith("--heads") for a in container(deployment)["args"])
    r = Rendered(chart.render({"target": {"heads": "/models/heads/qwen-1"}}, name=RELEASE, namespace=NAMESPACE,
                              is_install=True))
    assert "--heads=/models/heads/qwen-1" in container(r.one("Deployment", "target"))["args"]
    assert not any(a.startswith("--heads") for a in container(r.one("Deployment", "draft"))["args"])
