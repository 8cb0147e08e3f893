"""OpenAPI 3.1 documents built from an app's route table (FastAPI cannot see msgspec types).

Schemas come from kvxferd.api.schema (the same components as proto/schemas, field docstrings
included); every error status answers an ErrorBody. Served at /openapi.json of each app and
written to proto/openapi/ by scripts/gen_proto.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvxferd.api.schema import components
from kvxferd.wire import MANIFEST_VERSION, PROTOCOL_VERSION, ErrorBody

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvxferd.api.operations import Operation

API_VERSION = "1"
"""Version of both HTTP APIs, the ``/v1`` of their paths."""
REF = "#/components/schemas/{name}"

HEALTH = {
    "type": "object",
    "properties": {"status": {"const": "ok", "description": "Always ok."}},
    "required": ["status"],
}
"""Answer of /healthz (both apps)."""

# Status -> (component name, meaning). The meaning is the same for every operation that lists it.
ERRORS: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "The body is not JSON (DecodeError)."),
    401: ("Unauthorized", "A peer request whose KVX1 signature is missing, stale, replayed or "
                          "wrong, or a ticket whose HMAC does not match (AuthError). Carries "
                          "WWW-Authenticate: KVX1."),
    404: ("NotFound", "No such hold (UnknownHoldError) or pull (UnknownPullError)."),
    409: ("Conflict", "The sidecar's state forbids it: a live hold for this request id "
                      "(DuplicateHoldError), an engine already registered "
                      "(AlreadyRegisteredError), incompatible manifests "
                      "(IncompatiblePeerError; ``field`` lists the fields that disagree), or a "
                      "signed ticket that does not bind to its hold (ClaimMismatchError; "
                      "``field`` names what differs)."),
    410: ("Gone", "The hold's lease ended; its blocks may already be reused (HoldExpiredError)."),
    422: ("UnprocessableContent", "A field has the wrong type, is unknown, missing or out of "
                                  "range; ``field`` is its path, e.g. ``block_ids[0][1]``."),
    500: ("InternalServerError", "An unexpected error (InternalError) or a setting of the "
                                 "server that is wrong (ConfigError); the sidecar keeps "
                                 "serving."),
    502: ("BadGateway", "NIXL or a peer failed (TransportError, HandshakeError)."),
    503: ("ServiceUnavailable", "No engine has registered with this sidecar yet "
                                "(NotRegisteredError)."),
}  # fmt: skip


def document(title: str, description: str, operations: list[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of one app's route table."""
    structs = [ErrorBody]
    for op in operations:
        for kind in (op.request, op.response):
            if isinstance(kind, type) and kind not in structs:
                structs.append(kind)
    used = sorted({status for op in operations for status in op.errors})
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": API_VERSION,
            "description": description,
            "x-protocol-version": PROTOCOL_VERSION,
            "x-manifest-version": MANIFEST_VERSION,
        },
        "paths": {},
        "components": {
            "schemas": dict(sorted(components(structs, REF).items())),
            "responses": {ERRORS[s][0]: _error_response(s) for s in used},
        },
    }
    if any(op.auth for op in operations):
        doc["components"]["securitySchemes"] = {
            "kvx1": {
                "type": "apiKey",
                "in": "header",
                "name": "Authorization",
                "description": "KVX1 request signature with the shared peer secret (never "
                "sent): see proto/README.md, Trust model.",
            }  # fmt: skip
        }
    for op in operations:
        doc["paths"].setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return doc


def install_openapi(app: FastAPI, build: Callable[[], dict[str, Any]]) -> None:
    """Serve ``build()`` (computed once) as the app's /openapi.json instead of FastAPI's own."""
    app.openapi = functools.cache(build)  # type: ignore[method-assign]


def _operation(op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary}
    rest = op.description.partition("\n")[2].strip()
    if rest:
        out["description"] = rest
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in op.path_params
    ]
    params += [
        {
            "name": q.name,
            "in": "query",
            "required": False,
            "description": q.doc,
            "schema": {**msgspec.json.schema(q.kind), "default": q.default},
        }
        for q in op.query
    ]
    if params:
        out["parameters"] = params
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": _json(op.request)}
    ok: dict[str, Any] = {"description": "Success." if op.response is not None else "Done."}
    if op.response is not None:
        ok["content"] = _json(op.response, op.media_type)
    out["responses"] = {str(op.status): ok}
    for status in op.errors:
        out["responses"][str(status)] = {"$ref": f"#/components/responses/{ERRORS[status][0]}"}
    out["security"] = [{"kvx1": []}] if op.auth else []
    return out


def _json(kind: type | dict[str, Any], media_type: str = "application/json") -> dict[str, Any]:
    schema = {"$ref": REF.format(name=kind.__name__)} if isinstance(kind, type) else kind
    return {media_type: {"schema": schema}}


def _error_response(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {"description": ERRORS[status][1], "content": _json(ErrorBody)}
    if status == 401:
        out["headers"] = {
            "WWW-Authenticate": {"description": "Always ``KVX1``.", "schema": {"type": "string"}}
        }
    return out
