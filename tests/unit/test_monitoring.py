"""deploy/prometheus-alerts.yml and deploy/grafana-dashboard.json name only what the worker exports.

Both files are loaded as Prometheus and Grafana load them (YAML rule groups;
dashboard JSON), every ``octo_`` name they mention is looked up in a real
text exposition of the worker's metrics registry (sample names derived from
each family's type: ``_total``/``_created`` for counters, ``_bucket``,
``_sum``, ``_count`` for histograms), and every label a selector matches on
or an aggregation groups by belongs to a metric of that expression. The
issue's four signals each have a rule. When ``promtool`` is installed, its
``check rules`` parses the alert rules and every dashboard query, and its
``test rules`` runs the alert scenarios in tests/unit/alerts_test.yml.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from octo_worker.daemon.metrics import WorkerMetrics

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
ALERT_TESTS = Path(__file__).resolve().parent / "alerts_test.yml"

_NAME = re.compile(r"\bocto_[a-z0-9_]*[a-z0-9]")
_SELECTOR = re.compile(r"\b(octo_[a-z0-9_]*[a-z0-9])\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


def exported() -> tuple[set[str], dict[str, set[str]]]:
    """Sample names of a real exposition, and each sample name's label names."""
    metrics = WorkerMetrics()
    # Label names are not in an exposition without children; the metric objects know them.
    label_names = {
        metric._name: set(metric._labelnames)
        for metric in vars(metrics).values()
        if isinstance(metric, MetricWrapperBase)
    }
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode("utf-8")):
        for suffix in _SUFFIXES[family.type]:
            sample = family.name + suffix
            names.add(sample)
            bucket = {"le"} if suffix == "_bucket" else set()
            labels[sample] = label_names.get(family.name, set()) | bucket
    return names, labels


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert rules
    return rules


def dashboard_queries() -> list[str]:
    document = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [
        target["expr"] for panel in document["panels"] for target in panel.get("targets", [])
    ]
    for variable in document["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    assert queries
    return queries


def check_expression(expr: str, names: set[str], labels: dict[str, set[str]]) -> None:
    used = set(_NAME.findall(expr))
    assert used, expr
    unknown = used - names
    assert not unknown, f"not exported by the worker: {sorted(unknown)} in {expr!r}"
    for name, matchers in _SELECTOR.findall(expr):
        for label in _MATCHER.findall(matchers):
            assert label in labels[name], f"{name} has no label {label!r} ({expr!r})"
    available = set().union(*(labels[name] for name in used))
    for grouping in _GROUPING.findall(expr):
        for label in filter(None, (part.strip() for part in grouping.split(","))):
            assert label in available, f"no metric of {expr!r} has the label {label!r}"


def test_every_alert_rule_names_exported_metrics_and_labels() -> None:
    names, labels = exported()
    for rule in alert_rules():
        assert rule["alert"].startswith("Octo")
        assert rule["labels"]["severity"] in ("warning", "critical")
        check_expression(rule["expr"], names, labels)
        # Names in the texts an operator reads must exist too.
        texts = " ".join(str(value) for value in rule.get("annotations", {}).values())
        assert set(_NAME.findall(texts)) <= names, rule["alert"]


def test_every_dashboard_query_names_exported_metrics_and_labels() -> None:
    names, labels = exported()
    for expr in dashboard_queries():
        check_expression(expr.replace("$scope", ".*"), names, labels)


def test_the_four_stuck_signals_each_have_an_alert() -> None:
    by_metric: dict[str, list[str]] = {}
    for rule in alert_rules():
        for name in _NAME.findall(rule["expr"]):
            by_metric.setdefault(name, []).append(rule["expr"])
    assert "octo_oldest_unresolved_pending_seconds" in by_metric
    assert "octo_sessions_poisoned_total" in by_metric
    queue_rules = by_metric["octo_queue_messages"]
    assert any('queue="octo.v5.dead"' in expr for expr in queue_rules)  # DLQ depth
    consumer_rules = by_metric["octo_queue_consumers"]
    assert any("== 0" in expr and "worker" in expr for expr in consumer_rules)


def test_every_runbook_names_a_section_of_the_operations_guide() -> None:
    guide = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", guide, flags=re.MULTILINE)
    }
    for rule in alert_rules():
        path, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert path == "docs/operations.md"
        assert anchor in anchors, rule["alert"]


def test_the_dashboard_is_grafana_json_with_unique_panel_ids() -> None:
    document = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert document["uid"] and document["title"]
    ids = [panel["id"] for panel in document["panels"]]
    assert len(ids) == len(set(ids))
    for panel in document["panels"]:
        if panel["type"] == "row":
            continue
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"]


# On the PATH, or where `make test` puts it: beside this environment's python.
PROMTOOL = shutil.which("promtool") or shutil.which(
    "promtool", path=str(Path(sys.executable).parent)
)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules_and_every_dashboard_query(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Each dashboard query as a recording rule: promtool parses every expression.
    recording = {
        "groups": [
            {
                "name": "octo-dashboard",
                "rules": [
                    {
                        "record": f"octo_dashboard:query_{index}",
                        "expr": expr.replace("$scope", ".*"),
                    }
                    for index, expr in enumerate(dashboard_queries())
                    if not expr.startswith("label_values(")
                ],
            }
        ]
    }
    queries = tmp_path / "dashboard-queries.yml"
    queries.write_text(yaml.safe_dump(recording), encoding="utf-8")
    parsed = subprocess.run(
        [PROMTOOL, "check", "rules", str(queries)], capture_output=True, text=True, timeout=60
    )
    assert parsed.returncode == 0, parsed.stdout + parsed.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
def test_promtool_alert_scenarios_fire_as_documented(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    # The scenarios check when each alert fires and with which labels; promtool
    # would also compare the annotations' text, which `check rules` already
    # parses: they run on a copy of the rules without annotations.
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    bare = tmp_path / "alerts.yml"
    bare.write_text(yaml.safe_dump(rules), encoding="utf-8")
    document = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    document["rule_files"] = [str(bare)]
    scenarios = tmp_path / "alerts_test.yml"
    scenarios.write_text(yaml.safe_dump(document), encoding="utf-8")
    tested = subprocess.run(
        [PROMTOOL, "test", "rules", str(scenarios)], capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
