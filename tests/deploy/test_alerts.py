"""The PrometheusRule: promtool accepts its groups, unit tests show each alert fires when it
should (and not on healthy traffic), and every expression uses only exported series."""

from __future__ import annotations

import yaml

from tests.deploy.manifests import K8S
from tests.deploy.promql import exported_series, selected_names
from tests.deploy.tools import require_tool, run_tool

RULE = K8S / "base" / "prometheusrule.yaml"
UNIT_TESTS = K8S.parents[1] / "tests" / "deploy" / "alerts_test.yaml"


def _groups() -> list[dict]:
    return yaml.safe_load(RULE.read_text(encoding="utf-8"))["spec"]["groups"]


def alert_names() -> list[str]:
    """Every alert the PrometheusRule defines."""
    return [r["alert"] for g in _groups() for r in g["rules"] if "alert" in r]


def _rules_file(tmp_path, annotations: bool = True):
    groups = _groups()
    if not annotations:
        for rule in (r for g in groups for r in g["rules"]):
            rule.pop("annotations", None)
    path = tmp_path / "kvxferd-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    return path


def test_promtool_check_rules_accepts_the_groups(tmp_path):
    promtool = require_tool("promtool")
    result = run_tool([promtool, "check", "rules", str(_rules_file(tmp_path))])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in result.stdout


def test_every_alert_is_unit_tested_and_the_tests_pass(tmp_path):
    promtool = require_tool("promtool")
    rules = _rules_file(tmp_path, annotations=False)
    spec = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))
    spec["rule_files"] = [str(rules)]
    tested = {
        case["alertname"]
        for test in spec["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert tested == set(alert_names())
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    result = run_tool([promtool, "test", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_use_only_exported_series_and_have_severity_and_summary():
    exported = set(exported_series())
    for group in _groups():
        for rule in group["rules"]:
            names = selected_names(rule["expr"])
            assert names and names <= exported, (rule["alert"], names - exported)
            assert rule["labels"]["severity"] in ("info", "warning", "critical")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
