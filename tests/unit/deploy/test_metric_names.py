"""Every metric the Prometheus rules and the Grafana dashboard query is one ember's /metrics exposes.

The names come from the PromQL (string literals removed, so label values never count); the exposed names from
the metric families of `Metrics().registry`, each with the sample names its type gives in the text format:
a counter family `x` is queried as `x_total`, a histogram `x` as `x_bucket`, `x_sum`, `x_count`. Families, not
samples: a labelled metric has no samples until a label set is used.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from ember.metrics import Metrics

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "ember-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ember.json"

# The sample names of a family `x`, by its type, in the Prometheus text format (prometheus_client's exposition).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def query_names(expr: str) -> tuple[set[str], set[str]]:
    """(ember metric names, recording-rule names with ember in them) that a PromQL expression reads."""
    tokens = set(_IDENTIFIER.findall(_STRING.sub('""', expr)))
    metrics = {t for t in tokens if t.startswith("ember_") and ":" not in t}
    recorded = {t for t in tokens if ":" in t and "ember_" in t}
    return metrics, recorded


def exposed_names(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


def rules() -> list[dict[str, str]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def missing(exprs: list[str]) -> list[str]:
    exposed = exposed_names(Metrics().registry)
    used = set().union(*(query_names(e)[0] for e in exprs))
    return sorted(used - exposed)


def test_names_are_read_from_promql() -> None:
    metrics, recorded = query_names(
        'histogram_quantile(0.99, sum by (model, le) (rate(ember_a_seconds_bucket{model!="", code=~"ember_x"}'
        "[$__rate_interval]))) / on (model) model:ember_b:rate5m + max_over_time(ember_c[10m:1m])"
        " > ignoring(le) label_values(ember_d_total, model)"
    )
    assert metrics == {"ember_a_seconds_bucket", "ember_c", "ember_d_total"}
    assert recorded == {"model:ember_b:rate5m"}


def test_exposed_names_follow_each_metric_type() -> None:
    r = CollectorRegistry()
    Counter("ember_c", "", ["model"], registry=r)
    Counter("ember_d_total", "", registry=r)
    Gauge("ember_g", "", ["model"], registry=r)
    Histogram("ember_h_seconds", "", ["model"], registry=r)
    Summary("ember_s", "", registry=r)
    names = exposed_names(r)
    assert {"ember_c_total", "ember_d_total", "ember_g", "ember_h_seconds_bucket", "ember_h_seconds_sum",
            "ember_h_seconds_count", "ember_s_sum", "ember_s_count"} <= names
    assert not {"ember_c", "ember_d", "ember_d_total_total", "ember_g_total", "ember_h_seconds"} & names


def test_the_rules_read_only_metrics_ember_exposes() -> None:
    exprs = [rule["expr"] for rule in rules()]
    assert all(query_names(e)[0] or query_names(e)[1] for e in exprs)
    absent = missing(exprs)
    assert not absent, f"queried by deploy/prometheus/ember-rules.yml, not in ember.metrics.Metrics: {absent}"


def test_the_rules_read_only_recordings_they_define() -> None:
    defined = {rule["record"] for rule in rules() if "record" in rule}
    read = set().union(*(query_names(rule["expr"])[1] for rule in rules()))
    assert read <= defined


def test_the_dashboard_reads_only_metrics_ember_exposes() -> None:
    exprs = dashboard_exprs()
    assert all(query_names(e)[0] for e in exprs), "every dashboard query reads an ember metric"
    absent = missing(exprs)
    assert not absent, f"queried by deploy/grafana/ember.json, not in ember.metrics.Metrics: {absent}"
