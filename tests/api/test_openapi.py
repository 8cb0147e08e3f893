"""The OpenAPI documents describe exactly what the apps serve: every route of the table, typed
bodies from the wire Structs, ErrorBody for every error status, signature auth where it applies."""

from __future__ import annotations

import inspect

import jsonschema
import msgspec
import pytest

from kvxferd.api import engine, peer
from kvxferd.api.openapi import ERRORS, error_statuses
from kvxferd.wire import ErrorBody, PullStatus, Ticket

DOCS = {"engine": (engine.engine_document, engine.OPERATIONS),
        "peer": (peer.peer_document, peer.OPERATIONS)}  # fmt: skip


@pytest.fixture(params=sorted(DOCS))
def api(request):
    build, operations = DOCS[request.param]
    return build(), operations


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _resolve(doc: dict, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def test_the_document_is_openapi_3_1_with_every_route_of_the_table(api):
    doc, operations = api
    assert doc["openapi"] == "3.1.0" and doc["info"]["version"] == "1"
    served = {(op.method.lower(), op.path) for op in operations}
    documented = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert documented == served
    ids = [item[m]["operationId"] for item in doc["paths"].values() for m in item]
    assert len(ids) == len(set(ids))


def test_each_summary_is_the_first_paragraph_of_the_handler_docstring_on_one_line(api):
    doc, operations = api
    for op in operations:
        entry = doc["paths"][op.path][op.method.lower()]
        source = inspect.getdoc(op.handler) if op.handler else op.doc
        assert entry["summary"] == " ".join(source.split("\n\n")[0].split())


def test_a_summary_that_wraps_is_not_cut_mid_sentence():
    doc = engine.engine_document()
    summary = doc["paths"]["/v1/identity"]["get"]["summary"]
    assert summary.endswith("generation -1 while nothing is registered."), summary


def test_every_reference_resolves(api):
    doc, _ = api
    refs = _refs(doc)
    assert refs
    for ref in refs:
        assert isinstance(_resolve(doc, ref), dict), ref


def test_bodies_are_the_wire_structs_of_the_table(api):
    doc, operations = api
    for op in operations:
        entry = doc["paths"][op.path][op.method.lower()]
        ok = entry["responses"][str(op.status)]
        if op.request is not None:
            schema = entry["requestBody"]["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{op.request.__name__}"}
        if isinstance(op.response, type):
            schema = ok["content"]["application/json"]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{op.response.__name__}"}
        if op.response is None:
            assert "content" not in ok


def test_every_error_status_answers_an_error_body(api):
    doc, operations = api
    for op in operations:
        responses = doc["paths"][op.path][op.method.lower()]["responses"]
        assert {int(s) for s in responses} == {op.status, *error_statuses(op)}
        assert set(op.errors) <= set(error_statuses(op))
        if op.request is not None:  # the body limits of the edge
            assert {408, 413} <= set(error_statuses(op))
        for status in error_statuses(op):
            resolved = _resolve(doc, responses[str(status)]["$ref"])
            assert resolved["description"] == ERRORS[status][1]
            schema = resolved["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorBody"}
            assert ("headers" in resolved) == (status == 401)


def test_signature_auth_is_declared_exactly_on_the_peer_v1_operations(api):
    doc, operations = api
    for op in operations:
        security = doc["paths"][op.path][op.method.lower()]["security"]
        assert security == ([{"kvx1": []}] if op.path.startswith("/v1/") and op in
                            peer.OPERATIONS else [])  # fmt: skip
    has_scheme = "securitySchemes" in doc["components"]
    assert has_scheme == any(op.auth for op in operations)


def test_every_property_of_every_schema_is_described(api):
    doc, _ = api
    missing = [
        f"{name}.{field}"
        for name, comp in doc["components"]["schemas"].items()
        for field, prop in comp.get("properties", {}).items()
        if not prop.get("description") and not (field == "type" and len(prop.get("enum", [])) == 1)
    ]
    assert missing == []
    assert "ErrorBody" in doc["components"]["schemas"]


def test_the_long_poll_parameter_is_typed_and_bounded_below():
    doc = engine.engine_document()
    params = doc["paths"]["/v1/pulls/{pull_id}"]["get"]["parameters"]
    by_name = {p["name"]: p for p in params}
    assert by_name["pull_id"]["in"] == "path" and by_name["pull_id"]["required"] is True
    wait = by_name["wait"]
    assert wait["schema"] == {"type": "number", "minimum": 0, "default": 0.0}
    assert f"{engine.MAX_WAIT_S:g}" in wait["description"]


def test_the_documents_schemas_accept_real_messages_and_reject_wrong_ones():
    for build, _ in DOCS.values():
        for comp in build()["components"]["schemas"].values():
            jsonschema.Draft202012Validator.check_schema(comp)
    doc = engine.engine_document()

    def validator(name: str):
        root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        return jsonschema.Draft202012Validator(root)

    ticket = Ticket(
        engine_id="e",
        epoch=1,
        hold_id="h",
        request_id="r",
        block_ids=[[1, 2]],
        num_tokens=3,
        expires_at=1.5,
        tp_rank=0,
        tp_size=1,
        peer="h:1",
        token="ab",
    )
    validator("Ticket").validate(msgspec.to_builtins(ticket))
    validator("PullStatus").validate(msgspec.to_builtins(PullStatus(pull_id="p", state="done")))
    validator("ErrorBody").validate(msgspec.to_builtins(ErrorBody(error="E", detail="d")))
    bad = {**msgspec.to_builtins(ticket), "block_ids": [[1, "x"]]}
    assert not validator("Ticket").is_valid(bad)
    assert not validator("PullStatus").is_valid({"pull_id": "p", "state": "sideways"})
