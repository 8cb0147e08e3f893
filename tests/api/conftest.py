"""Fixtures of the API tests: the apps served in-process (Starlette's TestClient, one event loop
per client) in front of either a real Sidecar (NIXL agent, shared-memory pool) or a fake.

The fake records what the apps pass down and raises what a test tells it to; it is only used
for the HTTP mapping (status codes, bodies, parameter parsing), never for "the sidecar works".
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvxferd.api.engine import engine_app  # noqa: E402
from kvxferd.api.peer import peer_app  # noqa: E402
from kvxferd.config import Config  # noqa: E402
from kvxferd.metrics import Metrics  # noqa: E402
from kvxferd.sidecar.service import Sidecar  # noqa: E402
from kvxferd.sidecar.signing import PeerKeys, sign_request  # noqa: E402
from kvxferd.wire import (  # noqa: E402
    FinishedPulls,
    HeartbeatResponse,
    PullAccepted,
    PullStatus,
    RegisterRequest,
    ReleasedHolds,
)
from tests.sidecar.harness import TOKEN, EnginePool, plan  # noqa: E402

JSON = {"Content-Type": "application/json"}
KEYS = PeerKeys.of(TOKEN)


def signed(method: str, path: str, body: bytes, keys: PeerKeys = KEYS, **kw: Any) -> dict:
    """Headers of a request signed as a peer sidecar signs it (``kw``: now=, nonce=)."""
    return {"Authorization": sign_request(keys, method, path, body, **kw), **JSON}


def post(client: TestClient, path: str, body: object, keys: PeerKeys = KEYS, **kw: Any):
    """POST ``body`` (a Struct, builtins, or raw bytes) signed with ``keys`` (again at the ts a
    401 names, as a peer sidecar does, unless ``now`` is given)."""
    import msgspec

    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    resp = client.post(path, content=raw, headers=signed("POST", path, raw, keys, **kw))
    floor = resp.json().get("not_before", 0) if resp.status_code == 401 else 0
    if floor and "now" not in kw:  # a sidecar started lately: signed again at the ts it names
        resp = client.post(path, content=raw, headers=signed("POST", path, raw, keys, now=floor))
    return resp


class FakeSidecar:
    """Stands in for Sidecar behind the apps: records calls, raises ``self.fail`` if set."""

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.config = SimpleNamespace(peer_token=TOKEN, peer_token_previous="", auth_skew_s=30.0)
        self.metrics = Metrics()
        self.calls: list[tuple[str, Any]] = []
        self.fail: BaseException | None = None

    def readiness(self) -> dict[str, Any]:
        return {"ready": True}

    def _call(self, name: str, arg: Any) -> None:
        self.calls.append((name, arg))
        if self.fail is not None:
            raise self.fail

    async def register(self, req: RegisterRequest) -> Any:
        self._call("register", req)

    def hold(self, req: Any) -> Any:
        self._call("hold", req)

    def abort(self, req: Any) -> None:
        self._call("abort", req)

    async def start_pull(self, req: Any) -> PullAccepted:
        self._call("start_pull", req)
        return PullAccepted(pull_id="p1")

    async def pull_status(self, pull_id: str, wait_s: float) -> PullStatus:
        self._call("pull_status", (pull_id, wait_s))
        return PullStatus(pull_id=pull_id, state="pending")

    async def run_pull(self, req: Any) -> PullStatus:
        self._call("run_pull", req)
        return PullStatus(pull_id="p1", state="done", kv_bytes=64)

    def finished_pulls(self, cursor: int, limit: int) -> FinishedPulls:
        self._call("finished_pulls", (cursor, limit))
        return FinishedPulls(pulls=[], cursor=cursor)

    async def keepalive(self, req: Any) -> HeartbeatResponse:
        self._call("keepalive", req)
        return HeartbeatResponse(extended=[t.hold_id for t in req.tickets], missing=[])

    def released_since(self, cursor: int, limit: int | None = None) -> ReleasedHolds:
        self._call("released_since", (cursor, limit))
        return ReleasedHolds(holds=[], cursor=cursor)

    async def decline(self, req: Any) -> Any:
        self._call("decline", req)

    async def accept_handshake(self, req: Any) -> Any:
        self._call("accept_handshake", req)

    async def claim(self, req: Any) -> Any:
        self._call("claim", req)

    def accept_decline(self, req: Any) -> Any:
        self._call("accept_decline", req)

    def heartbeat(self, req: Any) -> Any:
        self._call("heartbeat", req)


@pytest.fixture
def fake() -> FakeSidecar:
    return FakeSidecar()


@pytest.fixture
def fake_engine(fake: FakeSidecar) -> Iterator[TestClient]:
    """The engine app in front of the fake."""
    with TestClient(engine_app(fake), raise_server_exceptions=False) as client:  # type: ignore[arg-type]
        yield client


@pytest.fixture
def fake_peer(fake: FakeSidecar) -> Iterator[TestClient]:
    """The peer app in front of the fake."""
    with TestClient(peer_app(fake), raise_server_exceptions=False) as client:  # type: ignore[arg-type]
        yield client


@pytest.fixture(scope="module")
def real() -> Iterator[SimpleNamespace]:
    """A real Sidecar with a registered llama-3.1-8b pool of 8 blocks, and both apps on it.

    ``real.engine`` / ``real.peer`` are TestClients; ``real.manifest`` the registered one.
    """
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    sidecar = Sidecar(Config(peer_token=TOKEN, engine_id="api-test", hold_grace_s=0.2))
    sidecar.peer_address = "127.0.0.1:9"
    try:
        with (
            TestClient(engine_app(sidecar), raise_server_exceptions=False) as engine,
            TestClient(peer_app(sidecar), raise_server_exceptions=False) as peer,
        ):
            body = RegisterRequest(manifest=manifest, regions=pool.specs())
            resp = engine.post("/v1/register", content=_encode(body), headers=JSON)
            assert resp.status_code == 200, resp.text
            yield SimpleNamespace(
                sidecar=sidecar, engine=engine, peer=peer, manifest=sidecar.manifest, pool=pool
            )
    finally:
        asyncio.run(sidecar.close())
        pool.close()


@pytest.fixture
def fresh() -> Iterator[SimpleNamespace]:
    """A real Sidecar nobody has registered with yet (and a pool to register), engine app on it."""
    manifest = plan("llama-3.1-8b", num_blocks=4)
    pool = EnginePool(manifest)
    sidecar = Sidecar(Config(peer_token=TOKEN))
    try:
        with TestClient(engine_app(sidecar), raise_server_exceptions=False) as engine:
            yield SimpleNamespace(sidecar=sidecar, engine=engine, manifest=manifest, pool=pool)
    finally:
        asyncio.run(sidecar.close())
        pool.close()


def _encode(value: object) -> bytes:
    import msgspec

    return msgspec.json.encode(value)
