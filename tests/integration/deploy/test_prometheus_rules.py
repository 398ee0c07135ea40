"""deploy/prometheus through the real promtool: the rules check, their unit tests pass, the dashboard's queries parse.

promtool comes from Debian's prometheus package (`make system`); without it these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "ember-rules.yml"
RULES_TESTS = ROOT / "deploy" / "prometheus" / "ember-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ember.json"

# What Grafana substitutes for the dashboard's variables before it sends a query.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "${datasource}": "", "$model": ".+",
                     "$version": ".+"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run `make system` (apt-get install prometheus)")
    return path


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_rules_pass_promtool_check(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_rules_unit_tests_pass(promtool: str) -> None:
    out = run(promtool, "test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_broken_threshold_fails_the_unit_tests(promtool: str, tmp_path: Path) -> None:
    """The unit tests can fail: with the P99 threshold above what "tail" reaches, its expected alert is missing."""
    rules = RULES.read_text()
    assert "p99_5m > 0.130" in rules
    (tmp_path / RULES.name).write_text(rules.replace("p99_5m > 0.130", "p99_5m > 0.210"))
    shutil.copy(RULES_TESTS, tmp_path / RULES_TESTS.name)
    out = run(promtool, "test", "rules", RULES_TESTS.name, cwd=tmp_path)
    assert out.returncode != 0
    assert "EmberLatencyP99High" in out.stdout + out.stderr


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SELECTOR, label) is Grafana's; its selector is PromQL.
            query = variable["query"]["query"]
            assert query.startswith("label_values(") and query.endswith(")")
            exprs.append(query[len("label_values("):-1].rsplit(",", 1)[0])
    return exprs


def test_every_dashboard_query_parses(promtool: str, tmp_path: Path) -> None:
    """Each query, its Grafana variables substituted, is the expression of a recording rule promtool checks."""
    rules = []
    for i, expr in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout
