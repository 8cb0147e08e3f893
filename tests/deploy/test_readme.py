"""deploy/README.md documents every setting, flag, metric and alert the code defines."""

from __future__ import annotations

from kvxferd.config import env_help
from tests.deploy.promql import family_names
from tests.deploy.readme import README, expected_block, serve_flags
from tests.deploy.test_alerts import alert_names


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def test_config_table_is_current():
    assert expected_block() in _readme(), "run: python -m tests.deploy.readme"


def test_every_env_var_and_serve_flag_is_documented():
    text = _readme()
    for env, _ in env_help():
        assert f"`{env}`" in text, env
    for flag in serve_flags().values():
        assert f"`{flag}" in text, flag


def test_the_config_table_names_the_flag_that_turns_a_switch_on():
    assert "| `KVXFERD_PREPPED_READS` | `--prepped-reads` |" in _readme()


def test_every_metric_and_alert_is_documented():
    text = _readme()
    for name in family_names():
        assert f"| `{name}` |" in text, name
    for alert in alert_names():
        assert f"| `{alert}` |" in text, alert


def test_ports_and_ucx_settings_are_documented():
    text = _readme()
    for item in ("7600", "8000", "/run/kvxferd/engine.sock", "UCX_NET_DEVICES", "UCX_TLS",
                 "KVXFERD_PROGRESS_THREAD", "/dev/shm", "CUDA IPC"):  # fmt: skip
        assert item in text, item
