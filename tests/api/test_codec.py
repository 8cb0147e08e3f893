"""The msgspec edge: validation messages become ErrorBody with the path once; every kvxferd error
has a deliberate HTTP status; anything else is a 500."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from kvxferd import errors
from kvxferd.api.codec import HTTPProblem, problem_for, problem_response, validation_body
from kvxferd.wire import ClaimRequest, DeclineRequest, ErrorBody, HoldRequest, RegisterRequest


def _message(kind: type, data: bytes) -> str:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(data, type=kind)
    return str(info.value)


@pytest.mark.parametrize(
    ("kind", "data", "field", "detail"),
    [
        (HoldRequest, b'{"request_id": "r", "block_ids": [[1, "x"]], "num_tokens": 1}',
         "block_ids[0][1]", "block_ids[0][1]: Expected `int`, got `str`"),
        (HoldRequest, b'{"request_id": "r", "block_ids": [], "num_tokens": 1, "extra": 1}',
         "extra", "extra: unknown field"),
        (HoldRequest, b'{"block_ids": [], "num_tokens": 1}',
         "request_id", "request_id: missing required field"),
        (RegisterRequest, b'{"regions": [{"type": "tape"}], "manifest": {}}',
         "regions[0].type", "regions[0].type: Invalid value 'tape'"),
        (RegisterRequest, b'{"manifest": {"model": "m"}, "regions": []}',
         "manifest.num_blocks", "manifest.num_blocks: missing required field"),
        (HoldRequest, b"[]", "", "Expected `object`, got `array`"),
        (ClaimRequest, b'{"reader": "' + b"r" * 257 + b'"}',
         "reader", "reader: Expected `str` of length <= 256"),
        (DeclineRequest, b'{"reason": "' + b"x" * 257 + b'", "tickets": []}',
         "reason", "reason: Expected `str` of length <= 256"),
        (HoldRequest, b'{"request_id": "r", "block_ids": [], "num_tokens": 1, '
                      b'"x\\nkvxferd ready\\u2028\\u009b": 1}',
         "x\\nkvxferd ready\\u2028\\x9b", "x\\nkvxferd ready\\u2028\\x9b: unknown field"),
    ],
    ids=["wrong-type", "unknown-field", "missing-field", "bad-tag", "nested-missing", "root",
         "long-reader", "long-reason", "unknown-field-breaking-lines"],
)  # fmt: skip
def test_a_validation_message_becomes_the_field_path_and_a_detail_naming_it_once(
    kind, data, field, detail
):
    body = validation_body(_message(kind, data))
    assert body == ErrorBody(error="ValidationError", detail=detail, field=field)


def _leaf_errors() -> list[type[errors.KvxferdError]]:
    out, todo = [], [errors.KvxferdError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in out if c.__module__ == errors.__name__]


ARGS = {"field": "some.field", "reason": "is wrong", "detail": "more", "current": "a",
        "new": "b", "fields": {"num_blocks": (1, 2)}}  # fmt: skip


def _instance(cls: type[errors.KvxferdError]) -> errors.KvxferdError:
    """An instance built from whatever its constructor requires."""
    if cls.__init__ is errors.KvxferdError.__init__:
        return cls("message")
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return cls(**{p.name: ARGS[p.name] for p in params if p.default is p.empty})


EXPECTED = {
    "AuthError": 401, "UnknownHoldError": 404, "HoldExpiredError": 410,
    "IncompatiblePeerError": 409, "DuplicateHoldError": 409, "StateError": 409,
    "ConfigError": 500, "NotRegisteredError": 503, "AlreadyRegisteredError": 409,
    "UnknownPullError": 404, "HoldRequestError": 422, "BlockIdError": 422, "ManifestError": 422,
    "UnsupportedModelError": 422, "MemoryRegionError": 422, "HandshakeError": 502,
    "TransportError": 502, "RegistrationError": 502, "PeerDisconnectedError": 502,
    "TransferFailedError": 502, "TransferTimeoutError": 502, "TransportLookupError": 502,
    "DescriptorError": 502,
}  # fmt: skip


@pytest.mark.parametrize("cls", _leaf_errors(), ids=lambda c: c.__name__)
def test_every_kvxferd_error_has_an_error_status_and_keeps_its_class_name(cls):
    exc = _instance(cls)
    problem = problem_for(exc)
    assert 400 <= problem.status < 600
    if cls.__name__ in EXPECTED:
        assert problem.status == EXPECTED[cls.__name__]
    assert problem.body.error == cls.__name__
    assert problem.body.detail == str(exc)
    field = "num_blocks" if cls is errors.IncompatiblePeerError else getattr(exc, "field", "")
    assert problem.body.field == field


def test_a_foreign_exception_is_a_500_internal_error():
    problem = problem_for(KeyError("x"))
    assert problem.status == 500
    assert problem.body == ErrorBody(error="InternalError", detail="KeyError: 'x'")


def test_an_http_problem_passes_through_unchanged():
    problem = HTTPProblem(418, ErrorBody(error="Teapot", detail="short and stout"))
    assert problem_for(problem) is problem


def test_only_a_401_carries_www_authenticate():
    assert problem_response(errors.AuthError("no")).headers["www-authenticate"] == "KVX1"
    assert "www-authenticate" not in problem_response(errors.UnknownHoldError("no")).headers


def test_an_error_response_body_is_exactly_an_error_body():
    resp = problem_response(errors.BlockIdError("block_ids[0][0]", "out of range"))
    body = msgspec.json.decode(resp.body, type=ErrorBody)
    assert (resp.status_code, body.field) == (422, "block_ids[0][0]")
    assert body.detail == "block_ids[0][0]: out of range"
