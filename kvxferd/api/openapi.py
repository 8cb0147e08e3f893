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

from kvxferd import errors
from kvxferd.api.schema import components
from kvxferd.wire import MANIFEST_VERSION, PROTOCOL_VERSION, ErrorBody

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvxferd.api.operations import Operation

API_VERSION = "1"
"""Version of both HTTP APIs, the ``/v1`` of their paths."""
REF = "#/components/schemas/{name}"

INTEGERS = (
    " Integers in bodies are JSON integer literals (1, never 1.0); query parameters also take "
    "integral numbers."
)
"""JSON Schema's integer admits 1.0, which kvxferd's bodies refuse: said once in each document."""

HEALTH = {
    "type": "object",
    "properties": {"status": {"const": "ok", "description": "Always ok."}},
    "required": ["status"],
}
"""Answer of /healthz (both apps)."""

_NAMES = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 408: "RequestTimeout",
          409: "Conflict", 410: "Gone", 413: "ContentTooLarge", 422: "UnprocessableContent",
          431: "HeadersTooLarge", 500: "InternalServerError", 502: "BadGateway",
          503: "ServiceUnavailable"}  # fmt: skip
"""Component name of each error status's response."""
_EDGE = {
    400: "The body is not JSON, or nests too deeply (DecodeError); or a kvxferd error without "
         "a status of its own (KvxferdError).",
    401: "Missing or wrong credentials, or a ticket whose HMAC does not match. Carries "
         "WWW-Authenticate.",
    404: "No such thing (or no such route: NotFound).",
    408: "The request body did not arrive within the server's body timeout (the connection "
         "is closed); or an engine call came after its ``not_after_ns``: the engine had given "
         "it up, and nothing was done.",
    409: "The sidecar's state forbids it; for incompatible manifests ``field`` lists the "
         "fields that disagree.",
    410: "The hold's lease ended; its blocks may already be reused.",
    413: "The body is larger than the server's body limit (announced or while reading); the "
         "connection is closed.",
    422: "A field has the wrong type, is unknown, missing or out of range (ValidationError); "
         "``field`` is its path, e.g. ``block_ids[0][1]``.",
    431: "The request headers are larger than the server's header limit; the connection is "
         "closed.",
    500: "An unexpected error (InternalError); the sidecar keeps serving.",
    502: "NIXL or a peer failed.",
    503: "The sidecar cannot serve this now (not registered yet, a table is full, or no room "
         "for the body within the body timeout: Busy, connection closed); retry.",
}  # fmt: skip
"""What the HTTP edge itself means by each status; the error classes come from the tree."""
_NOT_SIDECAR = (errors.InvalidRequestError, errors.PoolExhaustedError)
"""Error classes only the OpenAI-style servers (sim) raise, never the sidecar APIs."""
BODY_ERRORS = (408, 413, 503)
"""Statuses every operation with a request body may answer (limits at the edge)."""
EDGE_ERRORS = (431,)
"""Statuses every operation may answer (limits at the edge)."""


def _error_docs() -> dict[int, tuple[str, str]]:
    """Status -> (component name, meaning): the edge's meaning plus every error class of the
    tree (kvxferd.errors) that answers with that status."""
    by_status: dict[int, list[str]] = {}
    for cls in errors.tree():
        if cls is not errors.KvxferdError and not issubclass(cls, _NOT_SIDECAR):
            by_status.setdefault(cls.status, []).append(cls.__name__)
    out = {}
    for status, name in _NAMES.items():
        raised = by_status.get(status)
        meaning = _EDGE[status] + (f" Raised as: {', '.join(raised)}." if raised else "")
        out[status] = (name, meaning)
    return out


ERRORS: dict[int, tuple[str, str]] = _error_docs()
"""Status -> (component name, meaning); the meaning is the same for every operation listing it."""


def document(title: str, description: str, operations: list[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of one app's route table."""
    structs = [ErrorBody]
    for op in operations:
        for kind in (op.request, op.response):
            if isinstance(kind, type) and kind not in structs:
                structs.append(kind)
    used = sorted({status for op in operations for status in error_statuses(op)})
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": API_VERSION,
            "description": description + INTEGERS,
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
    for status in error_statuses(op):
        out["responses"][str(status)] = {"$ref": f"#/components/responses/{ERRORS[status][0]}"}
    out["security"] = [{"kvx1": []}] if op.auth else []
    return out


def error_statuses(op: Operation) -> list[int]:
    """The error statuses an operation documents: its own, plus the body limits' if it has one."""
    extra = BODY_ERRORS if op.request is not None else ()
    return sorted({*op.errors, *extra, *EDGE_ERRORS})


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
