"""The proxy tests' rig: fake OpenAI backends (tests.proxy.fakes) over real loopback HTTP behind
an in-process proxy, and what the fakes saw of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from kvxferd.proxy import ProxySettings, proxy_app
from tests.proxy.fakes import FakeBackend, Seen, Served, fake_app, serve_app
from tests.sidecar.harness import wait_until

CLIENT_TIMEOUT_S = 30.0


@dataclass
class Rig:
    """Fake prefills and decodes behind a proxy."""

    prefills: list[FakeBackend]
    decodes: list[FakeBackend]
    proxy: Served
    backends: list[Served]
    app: FastAPI
    transport: Any = None

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.proxy.url, timeout=CLIENT_TIMEOUT_S)


def rig_maker() -> Iterator[Callable[..., Rig]]:
    """Makes rigs (``make(n_prefill, n_decode, timeout_s, ...)``); stops them all at the end."""
    started: list[Served] = []

    def make(
        n_prefill: int = 1,
        n_decode: int = 1,
        timeout_s: float = 10.0,
        extra_prefill: str = "",
        first_decode: str = "",
        transport: Callable[[int, int], Any] | None = None,
        **options: Any,
    ) -> Rig:
        prefills = [FakeBackend(f"P{i}", "prefill") for i in range(n_prefill)]
        decodes = [FakeBackend(f"D{i}", "decode") for i in range(n_decode)]
        backends = [serve_app(fake_app(f)) for f in prefills + decodes]
        started.extend(backends)
        p_urls = [b.url for b in backends[:n_prefill]] + ([extra_prefill] if extra_prefill else [])
        d_urls = ([first_decode] if first_decode else []) + [b.url for b in backends[n_prefill:]]
        settings = ProxySettings(tuple(p_urls), tuple(d_urls), timeout_s, **options)
        made = transport(backends[0].port, backends[n_prefill].port) if transport else None
        app = proxy_app(settings, made)
        proxy = serve_app(app)
        started.append(proxy)
        return Rig(prefills, decodes, proxy, backends, app, made)

    yield make
    for served in started:
        served.server.should_exit = True
    for served in started:
        served.stop()


def completion(prompt: str = "hello world", **extra: object) -> dict[str, object]:
    return {"model": "m", "prompt": prompt, "max_tokens": 16, **extra}


def release_bodies(fake: FakeBackend) -> list[dict[str, object]]:
    """The bodies of the release calls ``fake`` got."""
    return [s.body for s in fake.seen if s.path == "/v1/kv/release"]


def prefill_requests(fake: FakeBackend) -> list[Seen]:
    """The completion requests ``fake`` got."""
    return [s for s in fake.seen if s.path == "/v1/completions"]


def wait_release(rig: Rig) -> list[dict[str, object]]:
    """Wait (bounded) for the first prefill's release call; the bodies it got."""
    wait_until(lambda: release_bodies(rig.prefills[0]), 30.0, "the release call to the prefill")
    return release_bodies(rig.prefills[0])
