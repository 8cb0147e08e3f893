"""Metric names: the set the daemon exports, and the names a PromQL expression selects."""

from __future__ import annotations

import re
from collections.abc import Iterator

import promql_parser
from prometheus_client import CollectorRegistry

from kvxferd.metrics import Metrics

# Series names each metric type exposes in the text format (prometheus_client, created series on).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}
# Grafana's variables, replaced by something the parser accepts.
_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def exported_series() -> dict[str, set[str]]:
    """Series name -> label names, for every series a fresh ``Metrics()`` registry exposes."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    series: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = _declared_labels(metrics, family.name)
        for suffix in _SUFFIXES[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            if family.type == "info":
                extra = {"version", "backend"}
            series[family.name + suffix] = labels | extra
    return series


def family_names() -> set[str]:
    """The name an operator queries for each metric: ``_total`` counters, ``_info`` infos,
    histograms by their base name (``_bucket``/``_sum``/``_count`` follow)."""
    out = set()
    for family in Metrics(CollectorRegistry()).registry.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        out.add(family.name + suffix)
    return out


def _declared_labels(metrics: Metrics, family: str) -> set[str]:
    for value in vars(metrics).values():
        name = getattr(value, "_name", None)
        if name == family:
            return set(value._labelnames)
    return set()


def grafana_to_promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced (regex ones by ``.*``)."""
    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def selected_names(expr: str) -> set[str]:
    """Metric names of every vector and matrix selector in a PromQL expression (parsed)."""
    return {sel.name for sel in _selectors(promql_parser.parse(expr)) if sel.name}


def grouping_labels(expr: str) -> set[str]:
    """Label names used in ``by (...)`` / ``on (...)`` clauses of an expression."""
    out: set[str] = set()
    for node in _walk(promql_parser.parse(expr)):
        modifier = getattr(node, "modifier", None)
        labels = getattr(modifier, "labels", None)
        if labels:
            out.update(labels)
        matching = getattr(modifier, "matching", None)
        if matching is not None and getattr(matching, "labels", None):
            out.update(matching.labels)
    return out


def matcher_labels(expr: str) -> set[str]:
    """Label names matched in selectors (``{pod=~"..."}``), excluding ``__name__``."""
    out: set[str] = set()
    for sel in _selectors(promql_parser.parse(expr)):
        for m in sel.matchers.matchers:
            if m.name != "__name__":
                out.add(m.name)
    return out


def _selectors(node: object) -> Iterator[promql_parser.VectorSelector]:
    for n in _walk(node):
        if isinstance(n, promql_parser.VectorSelector):
            yield n


def _walk(node: object) -> Iterator[object]:
    yield node
    if isinstance(node, promql_parser.MatrixSelector):
        yield from _walk(node.vector_selector)
        return
    if isinstance(node, promql_parser.Call):
        for arg in node.args:
            yield from _walk(arg)
        return
    for attr in ("expr", "lhs", "rhs", "param"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, str | int | float):
            yield from _walk(child)
