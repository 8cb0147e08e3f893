"""Backend URL normalisation and round-robin order."""

from __future__ import annotations

import pytest

from kvxferd.errors import ConfigError
from kvxferd.proxy import RoundRobin, normalize_url


@pytest.mark.parametrize("url", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"])
def test_base_url_forms_are_one_server(url: str) -> None:
    assert normalize_url(url, "--decode") == "http://h:1"


@pytest.mark.parametrize("url", ["h:1", "ftp://h:1", "http://", "127.0.0.1:8000"])
def test_non_http_urls_are_refused_naming_the_flag(url: str) -> None:
    with pytest.raises(ConfigError, match="--prefill"):
        normalize_url(url, "--prefill")


@pytest.mark.parametrize(
    ("url", "why"),
    [("http://h:99999", "not a valid URL"), ("http://h:port", "not a valid URL"),
     ("http://[::1", "not a valid URL"), ("http://h:1/?model=x", "no query or fragment"),
     ("http://h:1#v1", "no query or fragment")],
)  # fmt: skip
def test_urls_a_request_could_not_be_sent_to_are_refused(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"--decode: .*{why}"):
        normalize_url(url, "--decode")


def test_credentials_in_a_url_are_refused_without_echoing_them() -> None:
    """They would not be sent, and every 502 a client gets names the backend's URL."""
    with pytest.raises(ConfigError, match="--prefill: .*credentials") as info:
        normalize_url("http://admin:hunter2@h:1", "--prefill")
    assert "hunter2" not in str(info.value)


def test_round_robin_cycles_in_the_given_order() -> None:
    rr = RoundRobin("decode", ["http://a:1", "http://b:2/v1"])
    assert [rr.next().url for _ in range(5)] == [
        "http://a:1", "http://b:2", "http://a:1", "http://b:2", "http://a:1",
    ]  # fmt: skip
    assert {b.role for b in rr.backends} == {"decode"}


def test_round_robin_needs_a_backend() -> None:
    with pytest.raises(ConfigError, match="--prefill: at least one URL"):
        RoundRobin("prefill", [])
