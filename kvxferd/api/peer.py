"""The peer-facing API (TCP, signed requests): handshake, claim, heartbeat, decline; plus metrics
and probes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from prometheus_client import make_asgi_app
from starlette.routing import Route

from kvxferd.api.codec import HTTPProblem, StructResponse, auth_problem
from kvxferd.api.openapi import HEALTH, document, install_openapi
from kvxferd.api.operations import Gate, Operation, mount
from kvxferd.errors import AuthError
from kvxferd.sidecar.signing import PeerKeys, RequestVerifier, request_target
from kvxferd.wire import (
    ClaimRequest,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
)

if TYPE_CHECKING:
    from kvxferd.sidecar.service import Sidecar

TITLE = "kvxferd peer API"
DESCRIPTION = (
    "What sidecars ask of each other, over TCP: handshake (once per engine id and epoch), "
    "claim a hold before reading its blocks with NIXL, heartbeat leases of queued requests, and "
    "decline holds that will not be read. Every /v1 call is signed with the shared peer secret, "
    "which never travels: 'Authorization: KVX1 key=<key id>, ts=<unix s>, nonce=<hex>, "
    "sig=<hex HMAC-SHA256 over method, path and query, sha256(body), ts, nonce and key id>' "
    "(see proto/README.md); a missing, stale, replayed or wrong signature is a 401 before the "
    "body is decoded. /healthz, /readyz and /metrics need none. Every 4xx/5xx body is an "
    "ErrorBody. Claims, heartbeats and declines are also served as signed MessagePack frames on "
    "the TCP port a handshake answer names (frames_port; proto/README.md, Frames on the peer "
    "port)."
)
READY = {
    "type": "object",
    "properties": {
        "ready": {"const": True, "description": "An engine has registered."},
        "require_transport": {"type": "string", "description": "rdma or any."},
        "self_test": {"type": "string", "description": "ok, or why the self-test READ failed."},
        "transports": {
            "type": "object",
            "description": "UCX transports seen: reads and messages, by endpoint kind "
            "(self, intra-node, inter-node), e.g. cma/memory, tcp/lo, rc_mlx5/mlx5_0:1.",
        },
    },
    "required": ["ready"],
}
METRICS = {"type": "string", "description": "Prometheus text exposition format."}


async def handshake(sidecar: Sidecar, req: Handshake) -> Handshake:
    """Exchange protocol version, manifest and NIXL agent metadata; answers with ours.

    The protocol version is checked first. A 409 lists every field that keeps the two manifests
    from exchanging blocks (``field`` is their comma-separated list).
    """
    return await sidecar.accept_handshake(req)


async def claim(sidecar: Sidecar, req: ClaimRequest) -> ClaimResponse:
    """Pin a hold while the caller reads it; 404 unknown hold, 410 expired (never readable).

    The ticket's HMAC is checked (401 when it does not match). The claim binds: the ticket's
    engine epoch and TP rank/size must be this sidecar's, its block ids the hold's, and every
    reader of a hold must announce the same ``reader_tp_size`` (a TP size the manifest allows,
    else 422); a mismatch is a 409 naming the field. The claim lasts ``claim_s`` (capped; the
    answer's ``claim_s`` is what was granted); the hold is released once every expected reader
    that claimed it has sent its NIXL notification. A hold id the engine chose and has not
    placed yet is waited for briefly (``--hold-grace``).
    """
    return await sidecar.claim(req)


async def heartbeat(sidecar: Sidecar, req: Heartbeat) -> HeartbeatResponse:
    """Extend the leases of holds whose requests are still queued on the decode side."""
    return sidecar.heartbeat(req)


async def decline(sidecar: Sidecar, req: DeclineRequest) -> DeclineResponse:
    """Release holds whose decode side will not read them (reason ``declined``).

    Every ticket's HMAC is checked (401 naming ``tickets[i].token``). A hold is released only
    when it is live, belongs to this engine epoch and registration generation and has the
    ticket's block ids and request (else ``missing``), and no reader has claimed it (else
    ``busy``: left to notifications or expiry).
    """
    return sidecar.accept_decline(req)


async def healthz(sidecar: Sidecar) -> dict[str, Any]:
    """Liveness: the process answers (no token)."""
    return {"status": "ok"}


async def readyz(sidecar: Sidecar) -> dict[str, Any]:
    """Readiness: an engine has registered its memory with the NIXL agent, the self-test READ
    passed and, under ``--require-transport rdma``, READs can use RDMA and none went over TCP
    (else 503 naming why). Lists the UCX transports READs and notifications use (no token)."""
    return sidecar.readiness()


OPERATIONS = [
    Operation("POST", "/v1/handshake", handshake, Handshake, Handshake,
              errors=(400, 401, 409, 422, 500, 503), auth=True, needs_engine=True),
    Operation("POST", "/v1/claims", claim, ClaimRequest, ClaimResponse,
              errors=(400, 401, 404, 409, 410, 422, 500, 503), auth=True, needs_engine=True),
    Operation("POST", "/v1/heartbeat", heartbeat, Heartbeat, HeartbeatResponse,
              errors=(400, 401, 422, 500, 503), auth=True, needs_engine=True),
    Operation("POST", "/v1/decline", decline, DeclineRequest, DeclineResponse,
              errors=(400, 401, 422, 500, 503), auth=True, needs_engine=True),
    Operation("GET", "/healthz", healthz, None, HEALTH),
    Operation("GET", "/readyz", readyz, None, READY, errors=(503,), needs_engine=True),
    Operation("GET", "/metrics", None, None, METRICS, media_type="text/plain", name="metrics",
              doc="Prometheus metrics of this sidecar (no token)."),
]  # fmt: skip
"""The route table: served by peer_app, documented by peer_document."""
FRAME_OPERATIONS = [op for op in OPERATIONS if op.path in ("/v1/claims", "/v1/heartbeat",
                                                           "/v1/decline")]  # fmt: skip
"""What the framed peer listener serves: the per-pull calls (a handshake stays on HTTP: it
comes first, and its answer names the frames port)."""


def signature_check(verifier: RequestVerifier | None) -> Callable[[Request], Awaitable[None]]:
    """A Gate.authorize admitting only requests signed with one of our keys (nobody when no
    secret is configured). It reads the body (the signature covers its digest) but never
    decodes it: a request that fails is a 401 whatever its body."""

    async def authorize(request: Request) -> None:
        try:
            if verifier is None:
                raise AuthError("no peer secret is configured: nobody is admitted")
            body = await request.body()
            target = request_target(
                request.scope.get("raw_path", b"").decode("latin-1") or request.url.path,
                request.scope.get("query_string", b""),
            )
            verifier.verify(request.method, target, body, request.headers.get("authorization"))
        except AuthError as exc:
            raise HTTPProblem(401, auth_problem(exc)) from None

    return authorize


def peer_verifier(config: Any, started: float | None = None) -> RequestVerifier | None:
    """The request verifier of a sidecar's config (None when it has no secret); ``started``:
    when the sidecar started (Unix s), before which no signature is trusted after a restart."""
    if not config.peer_token:
        return None
    keys = PeerKeys.of(config.peer_token, getattr(config, "peer_token_previous", ""))
    return RequestVerifier(keys, skew_s=getattr(config, "auth_skew_s", 30.0), started=started)


def peer_gate(sidecar: Sidecar) -> Gate:
    """The peer API's gate, for HTTP and frames alike: one verifier, so a nonce seen on either
    listener is refused on both. Its signatures date from the sidecar's start (its epoch, ns):
    the nonces a process before it saw are gone."""
    epoch = getattr(sidecar, "epoch", None)  # None: a test's stand-in, not a process
    verifier = peer_verifier(sidecar.config, None if epoch is None else epoch / 1e9)

    def verify(method: str, target: str, body: bytes, signature: str) -> None:
        if verifier is None:
            raise AuthError("no peer secret is configured: nobody is admitted")
        verifier.verify(method, target, body, signature)

    return Gate(ready=lambda: sidecar.ready, authorize=signature_check(verifier), verify=verify)


def peer_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the peer API."""
    return document(TITLE, DESCRIPTION, OPERATIONS)


class _Asgi:
    """An ASGI app as a Route endpoint (a Mount would redirect /metrics to /metrics/)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def peer_app(sidecar: Sidecar, gate: Gate | None = None) -> FastAPI:
    """The FastAPI app other sidecars talk to; /metrics, /healthz and /readyz need no token.
    ``gate``: the one the framed listener shares (default: a new :func:`peer_gate`)."""
    app = FastAPI(title=TITLE, version="1", default_response_class=StructResponse)
    mount(app, OPERATIONS, sidecar, gate or peer_gate(sidecar))
    app.router.routes.append(
        Route("/metrics", _Asgi(make_asgi_app(sidecar.metrics.registry)), methods=["GET"])
    )
    install_openapi(app, peer_document)
    return app
