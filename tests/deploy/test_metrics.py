"""What a live ``kvxferd serve`` exports on /metrics: promtool-clean, and the set the dashboard
and the alert rules are checked against (``exported_series``)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.wire import HoldRequest, PullRequest
from tests.deploy.promql import exported_series
from tests.deploy.tools import require_tool, run_tool
from tests.sidecar.harness import EnginePool, plan, start_sidecar

pytestmark = pytest.mark.nixl


def test_exported_series_cover_every_metric_with_its_type_suffixes():
    series = exported_series()
    assert "kvxferd_pulls_total" in series and "kvxferd_pulls_created" in series
    assert {"kvxferd_transfer_duration_seconds_" + s for s in ("bucket", "sum", "count")} <= set(
        series
    )
    assert series["kvxferd_build_info"] == {"version", "backend"}
    assert series["kvxferd_pull_failures_total"] == {"reason"}
    assert "le" in series["kvxferd_pull_phase_duration_seconds_bucket"]


def test_every_name_follows_the_naming_rule_without_colons():
    for name in exported_series():
        assert name.startswith("kvxferd_") and ":" not in name, name


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """The /metrics text of a real sidecar after a hold, an abort, a hold and a pull."""
    tmp = tmp_path_factory.mktemp("scrape")
    sidecar = start_sidecar(str(tmp), "scraped")
    manifest = plan("llama-3.1-8b", num_blocks=4)
    pool = EnginePool(manifest)
    try:
        with sidecar.client() as client:
            client.register(manifest, pool.specs())
            first = client.hold(HoldRequest(request_id="r1", block_ids=[[1]], num_tokens=8))
            client.abort(first.hold_id)
            ticket = client.hold(HoldRequest(request_id="r2", block_ids=[[2]], num_tokens=8))
            # The sidecar pulls from itself: whatever the outcome, a pull is counted.
            pull = client.pull(PullRequest(tickets=[ticket], block_ids=[[3]], deadline_s=20))
            status = client.wait_pull(pull.pull_id, timeout_s=40)
            assert status.state in ("done", "failed")
        url = f"http://{sidecar.peer}/metrics"
        text = httpx.get(url, follow_redirects=True, timeout=10).text
    finally:
        assert sidecar.stop() == 0
        pool.close()
    return text


def test_live_scrape_passes_promtool_check_metrics(scrape):
    promtool = require_tool("promtool")
    result = run_tool([promtool, "check", "metrics"], stdin=scrape)
    assert result.returncode == 0, result.stdout + result.stderr


def test_live_scrape_exports_exactly_the_declared_series(scrape):
    scraped = {s.name for f in text_string_to_metric_families(scrape) for s in f.samples}
    scraped = {n for n in scraped if n.startswith("kvxferd_")}
    assert scraped <= set(exported_series()), scraped - set(exported_series())
    assert "kvxferd_pulls_total" in scraped


def test_live_scrape_counts_the_holds_and_the_pull(scrape):
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(scrape)
        for s in f.samples
    }
    assert values[("kvxferd_holds_created_total", ())] == 2
    assert values[("kvxferd_holds_released_total", (("reason", "aborted"),))] == 1
    pulls = sum(v for (n, _), v in values.items() if n == "kvxferd_pulls_total")
    assert pulls == 1
    backends = [dict(lbl)["backend"] for (n, lbl), _ in values.items() if n == "kvxferd_build_info"]
    assert backends == ["UCX"]
