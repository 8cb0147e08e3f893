"""Test helpers: real ``kvxferd sim`` processes started in parallel, and requests to them."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvxferd.sim.children import Child

TOKEN = "sim-test-secret"
READY_TIMEOUT_S = 120.0
STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Sim:
    """A running simulated engine."""

    name: str
    url: str
    child: Child

    def post(self, path: str, body: Mapping[str, Any] | bytes, **kw: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=90, **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def stats(self) -> dict[str, Any]:
        resp = self.get("/v1/stats")
        assert resp.status_code == 200, resp.text
        return resp.json()


def start_sims(specs: Mapping[str, Sequence[str]]) -> dict[str, Sim]:
    """Start one ``kvxferd sim`` per spec (its flags) at once; wait for all ready lines."""
    env = {**os.environ, "KVXFERD_PEER_TOKEN": TOKEN, "UCX_NET_DEVICES": "lo",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    children = {
        name: Child.spawn(
            name,
            [sys.executable, "-m", "kvxferd", "sim", "--log-level", "warning", *args],
            env=env,
            merge_stderr=True,
        )  # fmt: skip
        for name, args in specs.items()
    }
    sims: dict[str, Sim] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        for name, child in children.items():
            line = child.wait_line("kvxferd sim ready", max(0.0, deadline - time.monotonic()))
            fields = dict(kv.split("=", 1) for kv in line.split()[3:])
            sims[name] = Sim(name, fields["url"], child)
    except BaseException:
        for child in children.values():
            child.kill()
        raise
    return sims


@contextlib.contextmanager
def running_sims(specs: Mapping[str, Sequence[str]]) -> Iterator[dict[str, Sim]]:
    """``start_sims``; when the block ends, every sim is told to stop, then each waited for."""
    sims = start_sims(specs)
    try:
        yield sims
    finally:
        for sim in sims.values():
            sim.child.terminate()
        for sim in sims.values():
            sim.child.stop()


def text_of(kind: str, resp: httpx.Response) -> str:
    """The generated text of a JSON or SSE answer (SSE framing checked on the way)."""
    assert resp.status_code == 200, resp.text
    if not resp.headers["content-type"].startswith("text/event-stream"):
        choice = resp.json()["choices"][0]
        return choice["text"] if kind == "completion" else choice["message"]["content"]
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    want = "text_completion" if kind == "completion" else "chat.completion.chunk"
    assert {c["object"] for c in chunks} == {want}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    if kind == "completion":
        return "".join(c["choices"][0]["text"] for c in chunks)
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
