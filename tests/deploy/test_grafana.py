"""The Grafana dashboard: valid JSON, every query parses as PromQL and selects only series the
daemon exports, grouped and filtered only by labels those series (or the scrape) carry."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.promql import (
    exported_series,
    grafana_to_promql,
    grouping_labels,
    matcher_labels,
    selected_names,
)
from tests.deploy.tools import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "kvxferd.json"
# Target labels the PodMonitor gives every series (namespace/pod from the operator, role from the
# relabeling in deploy/k8s/base/podmonitor.yaml).
TARGET_LABELS = {"namespace", "pod", "role", "instance", "job", "container"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(_dashboard()) for t in p.get("targets", [])]


def _variable_queries() -> list[tuple[str, str]]:
    out = []
    for var in _dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((var["name"], query))
    return out


def test_dashboard_has_the_panels_operators_ask_for():
    titles = " | ".join(p["title"].lower() for p in _panels(_dashboard()))
    for topic in ("bytes/s", "latency", "failure", "holds", "expir", "per pod", "peers"):
        assert topic in titles, topic
    exprs = " ".join(e for _, e in _exprs())
    assert "histogram_quantile(0.99" in exprs and "_bucket" in exprs


def test_panel_ids_are_unique_and_every_panel_has_a_query():
    panels = _panels(_dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] != "row":
            assert p["targets"], p["title"]


@pytest.mark.parametrize(("title", "expr"), _exprs(), ids=[t for t, _ in _exprs()])
def test_query_parses_and_uses_only_exported_series(title, expr):
    promql = grafana_to_promql(expr)
    names = selected_names(promql)
    assert names, f"{title}: selects no metric"
    exported = exported_series()
    assert names <= set(exported), f"{title}: not exported: {names - set(exported)}"
    known = set().union(*(exported[n] for n in names)) | TARGET_LABELS
    used = grouping_labels(promql) | matcher_labels(promql)
    assert used <= known, f"{title}: unknown labels {used - known}"


@pytest.mark.parametrize(("name", "query"), _variable_queries())
def test_variable_queries_use_only_exported_series(name, query):
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert match, f"{name}: expected label_values(selector, label), got {query}"
    selector, label = match.groups()
    names = selected_names(grafana_to_promql(selector))
    assert names <= set(exported_series()), names
    assert label in TARGET_LABELS


def test_every_query_uses_the_dashboard_variables():
    for title, expr in _exprs():
        for var in ("$namespace", "$role", "$pod"):
            assert var in expr, f"{title}: does not filter by {var}"
