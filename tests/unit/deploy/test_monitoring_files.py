"""The shape of deploy/prometheus and deploy/grafana: what operators' tools need beyond valid syntax.

promtool itself (the rules check and their unit tests) runs in tests/integration/deploy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "ember-rules.yml"
RULES_TESTS = ROOT / "deploy" / "prometheus" / "ember-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ember.json"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_the_slo_alerts_are_there() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in alerts()}
    assert "p95_5m > 0.100" in exprs["EmberLatencyP95High"]
    assert "p99_5m > 0.130" in exprs["EmberLatencyP99High"]
    assert "ember_cold_starts" in exprs["EmberColdStartRateHigh"]
    assert "ember_jobs_oldest_age_seconds" in exprs["EmberJobQueueStale"]
    assert "ember_jobs_queued" in exprs["EmberJobQueueDeep"]
    assert "increase(ember_worker_crashes_total" in exprs["EmberInstancesCrashLooping"]


def test_the_latency_quantiles_are_per_model_and_version() -> None:
    records = {rule["record"]: rule["expr"] for rule in rules() if "record" in rule}
    for q in ("0.95", "0.99"):
        expr = " ".join(records[f"model_version:ember_request_duration_seconds:p{q[2:]}_5m"].split())
        assert expr.startswith(f"histogram_quantile({q}, sum by (model, version, le) (rate(")
        assert "ember_request_duration_seconds_bucket" in expr


def test_every_alert_has_a_duration_a_severity_and_names_its_model() -> None:
    for alert in alerts():
        assert re.fullmatch(r"\d+m", alert["for"]), alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        for key in ("summary", "description"):
            assert "{{ $labels.model }}" in alert["annotations"][key], (alert["alert"], key)
        assert "by (model, version)" in alert["expr"] or alert["expr"].startswith("model_version:"), alert["alert"]


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(RULES_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    cases = [case for group in tests["tests"] for case in group.get("alert_rule_test", [])]
    for name in {alert["alert"] for alert in alerts()}:
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name} is never expected to fire"
        assert any(not case["exp_alerts"] for case in mine), f"{name} is never expected to stay quiet"
        fired_labels = [a["exp_labels"] for case in mine for a in case["exp_alerts"]]
        assert all({"severity", "model", "version"} <= set(labels) for labels in fired_labels), name


def test_the_dashboard_has_a_prometheus_datasource_and_a_model_variable() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 39
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query"
    assert model["query"]["query"] == model["definition"] == "label_values(ember_requests_total, model)"
    assert model["datasource"] == DATASOURCE


def test_every_panel_queries_the_chosen_datasource_and_models() -> None:
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["refId"] and target["legendFormat"], panel["title"]
            # Every per-model metric is filtered by the model and version variables; the store's are per node.
            for name, selector in re.findall(r"(ember_[a-z0-9_]+)(\{[^}]*\})?", target["expr"]):
                if not name.startswith("ember_store_"):
                    assert 'model=~"$model"' in selector and 'version=~"$version"' in selector, (panel["title"], name)


def test_the_dashboard_shows_what_operators_asked_for() -> None:
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    for metric in (
        "ember_requests_total", "ember_request_duration_seconds_bucket",
        "ember_ladder_time_to_first_response_seconds_bucket", "ember_cold_starts_total", "ember_instances",
        "ember_autoscaler_desired_instances", "ember_requests_in_flight", "ember_queue_depth", "ember_jobs_queued",
        "ember_jobs_oldest_age_seconds", "ember_time_to_first_token_seconds_bucket",
        "ember_time_per_output_token_seconds_bucket", "ember_store_bytes",
    ):
        assert metric in exprs, metric
    latency = "sum by (model, version, le) (rate(ember_request_duration_seconds_bucket"
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, {latency}" in exprs
    assert "sum by (rung) (rate(ember_cold_starts_total" in exprs
    assert "sum by (instance, tier) (ember_store_bytes)" in exprs


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells
