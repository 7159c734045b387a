"""The Helm chart (helm/specdec) as a whole: linted with every value set, its values schema
rejecting bad values, every rendered manifest validated against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict), the template files' names, checkov run once over everything,
the chart's commands parsed by the real CLI, and values.yaml and values.schema.json kept complete
and in step with the service flags. The value sets and rendering are in tests/helm_render.py; what
the rendered manifests say is asserted in tests/test_helm_content.py.
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

from tests import helm_render
from tests.helm_render import (CHART, FULL, K8S_VERSION, NAMESPACE, RELEASE, VALUE_SETS, component_of, container,
                               helm, jsonschema, kubernetes_validate)

pytestmark = pytest.mark.process

chart, rendered = helm_render.chart, helm_render.rendered  # the shared fixtures, for this module's tests

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
    "CKV_K8S_15": "pinned by tag",  # pullPolicy IfNotPresent: runs an image loaded into kind / minikube
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
