"""The chart's Grafana dashboard (helm/specdec/dashboards/specdec.json): valid Grafana JSON whose
every query parses as PromQL. That each query names only series the services export is checked
on a real scrape of the three running services in tests/e2e/test_metrics_e2e.py, with the helpers
here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest

from specdec.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "specdec" / "dashboards" / "specdec.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's own interval variables, as a duration PromQL parses
GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
# what the dashboard must show (issue 34): a family per topic, at least
SHOWN = {
    "request rate and errors by status": {"specdec_requests_total", "specdec_http_requests_total"},
    "time to first token, per-token latency": {"specdec_time_to_first_token_seconds_bucket",
                                               "specdec_time_per_output_token_seconds_bucket"},
    "tokens per round, acceptance by source": {"specdec_tokens_per_round_sum", "specdec_num_accepted_tokens_total",
                                              "specdec_num_draft_tokens_total"},
    "γ and tree size chosen": {"specdec_num_speculative_tokens_sum", "specdec_num_tree_draft_tokens_total"},
    "batch sizes, queue depth, forward time": {"specdec_batch_size_bucket", "specdec_queue_depth",
                                               "specdec_round_latency_seconds_bucket"},
    "K/V chunk hits and restore time": {"specdec_kv_prefix_cache_hits_total", "specdec_kv_store_hits_total",
                                        "specdec_kv_restore_seconds_total"},
    "replicas up": {"specdec_service_info"},
}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def series_names(expr: str) -> set[str]:
    """The series an expression selects, by name: each vector selector's (a counter's as NAME_total,
    a histogram's as NAME_bucket, NAME_sum or NAME_count, as Prometheus stores them)."""
    assert "$" not in GRAFANA_INTERVALS.sub("", expr), f"a template variable other than Grafana's intervals: {expr}"
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name: {expr}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expr)), pre_visit=visit)
    return names


def exportable_series(exposition: str) -> set[str]:
    """The series names a /metrics page exposes or can expose: the samples on it, and for each
    family its type's series (a labelled family shows no sample before its first observation).
    prometheus_client's `_created` timestamps are left out."""
    names = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines()
             if line and not line.startswith("#")}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {f"{name}{suffix}" for suffix in {"histogram": ("_bucket", "_sum", "_count"),
                                                       "summary": ("", "_sum", "_count")}.get(kind, ("",))}
    return {name for name in names if not name.endswith("_created")}


def test_the_dashboard_is_grafana_json_on_a_datasource_variable():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "specdec" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    shown = [panel for panel in panels if panel["type"] != "row"]
    assert len(shown) >= 14 and {panel["type"] for panel in shown} <= {"timeseries", "stat"}
    for panel in shown:
        where = panel["title"]
        assert panel["description"], where
        assert panel["datasource"] == DATASOURCE, where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, where
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), where
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"] and "legendFormat" in target, where
    for panel in panels:  # rows and panels lie top to bottom, none over another
        assert panel["gridPos"]["y"] >= 0
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in panels]
    for i, a in enumerate(cells):
        for b in cells[i + 1:]:
            assert not (a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]), (a, b)


def test_every_query_parses_and_the_dashboard_shows_each_topic():
    used = set()
    for title, expr in queries(load_dashboard()):
        try:
            used |= series_names(expr)
        except ValueError as exc:
            pytest.fail(f"{title}: {expr}: {exc}")
    missing = {topic: names - used for topic, names in SHOWN.items() if names - used}
    assert not missing, missing


def test_series_names_are_read_exactly_from_the_queries():
    expr = ('histogram_quantile(0.99, sum by (service, le) (rate(specdec_batch_size_bucket{stage=~"draft"}'
            '[$__rate_interval]) * on (instance) group_left (service) specdec_service_info{service="target"}))'
            ' / ignoring (le) sum(specdec_queue_depth offset 5m)')
    assert series_names(expr) == {"specdec_batch_size_bucket", "specdec_service_info", "specdec_queue_depth"}
    with pytest.raises(ValueError):
        series_names("sum(rate(specdec_requests_total[5m])")


def test_exportable_series_follow_the_exposition_types():
    metrics = Metrics("coordinator")  # nothing recorded: the labelled families show no sample yet
    exported = exportable_series(metrics.render().decode())
    assert {"specdec_requests_total", "specdec_tokens_per_round_bucket", "specdec_tokens_per_round_count",
            "specdec_active_sessions", "specdec_service_info"} <= exported
    # what a query must not name: the family without its suffix, a timestamp, another service's
    assert not {"specdec_requests", "specdec_tokens_per_round", "specdec_requests_created",
                "specdec_batch_size_bucket"} & exported
