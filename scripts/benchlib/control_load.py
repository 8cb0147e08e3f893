"""Closed-loop request drivers of the control-plane benchmark: the same tiny completions sent
three ways, so their latencies can be subtracted.

- ``proxy``: client -> proxy -> prefill sim -> decode sim (the P/D path as users see it);
- ``direct``: the proxy's two calls made by the client itself (prefill with the transfer stub,
  then decode with the returned ``kv_transfer_params``), timed as a whole and per half;
- ``local``: the decode sim alone, without ``kv_transfer_params`` (computes locally, no
  transfer): the colocated baseline.

A request whose answer is not a 200 with one choice is counted in ``errors`` (with its
message), never timed; the texts are kept to check that all three ways produce the same tokens
(the sim's text is a function of the request's KV bytes).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from kvxferd.lanes import ssl_context
from kvxferd.proxy.bodies import encode, parse, prefill_body

JSON = {"Content-Type": "application/json"}
"""The content type of a body sent as bytes."""

MODES = ("proxy", "direct", "local")
PATH = "/v1/completions"


class LoadError(RuntimeError):
    """A request did not get a well-formed 200 answer (the numbers would mean nothing)."""


@dataclass(frozen=True)
class Endpoints:
    """Base URLs of the running cluster."""

    proxy: str
    prefill: str
    decode: str


@dataclass(frozen=True)
class Workload:
    """The request bodies: ``prompts`` cycled in order, each with ``max_tokens``."""

    model: str
    prompts: tuple[str, ...]
    max_tokens: int = 1

    def body(self, i: int) -> dict:
        """The i-th request's body (prompt ``i mod len(prompts)``)."""
        return {"model": self.model, "prompt": self.prompts[i % len(self.prompts)],
                "max_tokens": self.max_tokens}  # fmt: skip


@dataclass
class Samples:
    """Latencies (ms) of one mode at one concurrency, with the wall time they took."""

    mode: str
    latencies_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    halves_ms: list[tuple[float, float]] = field(default_factory=list)
    """``direct`` only: (prefill call, decode call) per request."""
    texts: dict[int, str] = field(default_factory=dict)
    """Answer text per prompt index."""
    errors: list[str] = field(default_factory=list)
    """Why each failed request failed (not in ``latencies_ms``)."""

    def extend(self, other: Samples) -> None:
        """Pool another round of the same mode."""
        self.latencies_ms += other.latencies_ms
        self.wall_s += other.wall_s
        self.halves_ms += other.halves_ms
        self.texts.update(other.texts)
        self.errors += other.errors

    @property
    def rps(self) -> float:
        """Completed requests per second of wall time."""
        return len(self.latencies_ms) / self.wall_s if self.wall_s > 0 else 0.0

    def pct(self, q: float) -> float:
        """The q-th percentile latency (ms, linear interpolation)."""
        return float(np.percentile(self.latencies_ms, q))


KEEPALIVE_S = 3.0
"""Idle connections are dropped after this, before uvicorn closes them (its default is 5 s):
reusing one the server is closing at that moment fails with a ReadError."""


def new_client(timeout_s: float = 60.0) -> httpx.AsyncClient:
    """A keep-alive client for ONE closed-loop worker (a connection to each of the proxy,
    prefill and decode). One shared client for many concurrent requests would measure httpx:
    its pool burns a full core at 32+ requests in flight on this kind of machine."""
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4,
                          keepalive_expiry=KEEPALIVE_S)  # fmt: skip
    # One SSL context for all workers: each new one loads the CA bundle (tens of ms of CPU,
    # 64 of them at concurrency 64, counted in the level's CPU per request).
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                             verify=ssl_context())  # fmt: skip


def answer(resp: httpx.Response, what: str) -> dict:
    """The JSON body of a 200 answer with one choice; LoadError naming ``what`` otherwise."""
    if resp.status_code != 200:
        raise LoadError(f"{what}: HTTP {resp.status_code}: {resp.text[:500]}")
    body = resp.json()
    if not isinstance(body, dict) or len(body.get("choices") or []) != 1:
        raise LoadError(f"{what}: answer without exactly one choice: {resp.text[:500]}")
    return body


async def one(
    client: httpx.AsyncClient, mode: str, ep: Endpoints, wl: Workload, i: int
) -> tuple[float, tuple[float, float] | None, str]:
    """Send request ``i`` the ``mode`` way: (latency ms, direct halves ms or None, text)."""
    try:
        return await _one(client, mode, ep, wl, i)
    except httpx.HTTPError as exc:
        raise LoadError(f"{mode} request {i}: {type(exc).__name__}: {exc}") from exc


async def _one(
    client: httpx.AsyncClient, mode: str, ep: Endpoints, wl: Workload, i: int
) -> tuple[float, tuple[float, float] | None, str]:
    body = wl.body(i)
    headers = {"X-Request-Id": f"bench-{mode}-{i}"}
    t0 = time.perf_counter()
    halves = None
    if mode == "proxy":
        out = answer(await client.post(ep.proxy + PATH, json=body, headers=headers), "proxy")
    elif mode == "local":
        out = answer(await client.post(ep.decode + PATH, json=body, headers=headers), "local")
    elif mode == "direct":
        p = answer(
            await client.post(
                ep.prefill + PATH,
                content=encode(prefill_body(parse(json.dumps(body).encode()), False)),
                headers={**headers, **JSON},
            ),
            "direct prefill",
        )
        params = p.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise LoadError("direct prefill: answer without kv_transfer_params")
        t1 = time.perf_counter()
        d_body = {**body, "kv_transfer_params": params}
        out = answer(await client.post(ep.decode + PATH, json=d_body, headers=headers), "direct")
        t2 = time.perf_counter()
        halves = ((t1 - t0) * 1e3, (t2 - t1) * 1e3)
    else:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    ms = (time.perf_counter() - t0) * 1e3
    return ms, halves, str(out["choices"][0].get("text", ""))


async def run(
    clients: list[httpx.AsyncClient], mode: str, ep: Endpoints, wl: Workload, n: int,
    first: int = 0,
) -> Samples:  # fmt: skip
    """``n`` requests (indices ``first``..) by one closed-loop worker per client."""
    out = Samples(mode)
    it = iter(range(first, first + n))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in it:
            try:
                ms, halves, text = await one(client, mode, ep, wl, i)
            except LoadError as exc:
                out.errors.append(str(exc))
                continue
            out.latencies_ms.append(ms)
            if halves is not None:
                out.halves_ms.append(halves)
            out.texts[i % len(wl.prompts)] = text

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients[:n]))
    out.wall_s = time.perf_counter() - t0
    return out


async def level(
    ep: Endpoints, wl: Workload, concurrency: int, n: int, rounds: int, warmup: int
) -> dict[str, Samples]:
    """Every mode at one concurrency: ``warmup`` untimed requests each, then ``n`` timed ones
    split into ``rounds`` rounds whose mode order rotates (so slow drift hits all modes)."""
    pooled = {m: Samples(m) for m in MODES}
    clients = [new_client() for _ in range(concurrency)]
    try:
        for m in MODES:  # warm-up: untimed, but its failures count
            pooled[m].errors += (await run(clients, m, ep, wl, warmup)).errors
        per_round = [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
        start = 0
        for r, k in enumerate(per_round):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            for m in order:
                pooled[m].extend(await run(clients, m, ep, wl, k, first=start))
            start += k
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return pooled
