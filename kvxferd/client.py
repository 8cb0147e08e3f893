"""Engine-side client of the sidecar's engine API (httpx over the Unix socket).

``EngineClient`` (sync) and ``AsyncEngineClient`` take and return wire Structs; an error answer
raises the kvxferd exception the sidecar raised (same class name), with the offending field.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
import msgspec

from kvxferd import errors
from kvxferd.wire import (
    AbortHoldRequest,
    AnyRegionSpec,
    ErrorBody,
    HoldRequest,
    Manifest,
    PullAccepted,
    PullRequest,
    PullStatus,
    RegisterRequest,
    RegisterResponse,
    ReleasedHolds,
    Ticket,
)

T = TypeVar("T")
_BASE = "http://kvxferd"


class SidecarError(errors.KvxferdError):
    """The sidecar answered an error we have no more specific class for."""

    def __init__(self, status: int, body: ErrorBody) -> None:
        super().__init__(f"{status} {body.error}: {body.detail}")
        self.status = status
        self.body = body
        self.field = body.field


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = msgspec.json.decode(resp.content, type=ErrorBody)
    except msgspec.MsgspecError:
        body = ErrorBody(error="HTTPError", detail=resp.text[:500])
    kind = getattr(errors, body.error, None)
    if isinstance(kind, type) and issubclass(kind, errors.KvxferdError):
        if issubclass(kind, errors.ManifestError | errors.BlockIdError | errors.HoldRequestError):
            reason = body.detail.removeprefix(f"{body.field}: ")
            exc: Exception = kind(body.field, reason)
        elif issubclass(kind, errors.IncompatiblePeerError | errors.PullError):
            exc = SidecarError(resp.status_code, body)
        else:
            exc = kind(body.detail)
        raise exc
    raise SidecarError(resp.status_code, body)


def _decode(resp: httpx.Response, kind: type[T]) -> T:
    _raise_for(resp)
    return msgspec.json.decode(resp.content, type=kind)


def _json(value: Any) -> dict[str, Any]:
    return {"content": msgspec.json.encode(value), "headers": {"Content-Type": "application/json"}}


class EngineClient:
    """Blocking client; one per engine rank."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=socket_path), base_url=_BASE, timeout=timeout_s
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, manifest: Manifest, regions: list[AnyRegionSpec]) -> RegisterResponse:
        """Register the KV manifest and where each region's memory is."""
        req = RegisterRequest(manifest=manifest, regions=regions)
        return _decode(self._http.post("/v1/register", **_json(req)), RegisterResponse)

    def hold(self, req: HoldRequest) -> Ticket:
        """Pin blocks of a prefilled request; returns its ticket."""
        return _decode(self._http.post("/v1/holds", **_json(req)), Ticket)

    def abort(self, hold_id: str) -> None:
        """Give up a hold."""
        _raise_for(self._http.post("/v1/holds/abort", **_json(AbortHoldRequest(hold_id=hold_id))))

    def pull(self, req: PullRequest) -> PullAccepted:
        """Start a pull."""
        return _decode(self._http.post("/v1/pulls", **_json(req)), PullAccepted)

    def pull_status(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """A pull's status, long-polling up to ``wait_s``."""
        resp = self._http.get(
            f"/v1/pulls/{pull_id}", params={"wait": wait_s}, timeout=wait_s + 10.0
        )
        return _decode(resp, PullStatus)

    def wait_pull(self, pull_id: str, timeout_s: float) -> PullStatus:
        """Block until a pull is done or failed (or ``timeout_s`` passed); returns its status."""
        import time

        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            status = self.pull_status(pull_id, wait_s=max(0.0, min(left, 30.0)))
            if status.state in ("done", "failed") or left <= 0:
                return status

    def released(self, cursor: int = 0) -> ReleasedHolds:
        """Holds released since ``cursor``."""
        return _decode(self._http.get("/v1/released", params={"cursor": cursor}), ReleasedHolds)


class AsyncEngineClient:
    """asyncio client; same methods as EngineClient, awaitable."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url=_BASE, timeout=timeout_s
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def register(self, manifest: Manifest, regions: list[AnyRegionSpec]) -> RegisterResponse:
        """Register the KV manifest and where each region's memory is."""
        req = RegisterRequest(manifest=manifest, regions=regions)
        return _decode(await self._http.post("/v1/register", **_json(req)), RegisterResponse)

    async def hold(self, req: HoldRequest) -> Ticket:
        """Pin blocks of a prefilled request; returns its ticket."""
        return _decode(await self._http.post("/v1/holds", **_json(req)), Ticket)

    async def abort(self, hold_id: str) -> None:
        """Give up a hold."""
        body = _json(AbortHoldRequest(hold_id=hold_id))
        _raise_for(await self._http.post("/v1/holds/abort", **body))

    async def pull(self, req: PullRequest) -> PullAccepted:
        """Start a pull."""
        return _decode(await self._http.post("/v1/pulls", **_json(req)), PullAccepted)

    async def pull_status(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """A pull's status, long-polling up to ``wait_s``."""
        resp = await self._http.get(
            f"/v1/pulls/{pull_id}", params={"wait": wait_s}, timeout=wait_s + 10.0
        )
        return _decode(resp, PullStatus)

    async def released(self, cursor: int = 0) -> ReleasedHolds:
        """Holds released since ``cursor``."""
        resp = await self._http.get("/v1/released", params={"cursor": cursor})
        return _decode(resp, ReleasedHolds)
