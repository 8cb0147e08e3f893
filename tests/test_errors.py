"""One place for error knowledge: every HTTP status and reason code any table uses is an
attribute of a class in kvxferd.errors, and the tree at the top of that module says the same."""

from __future__ import annotations

import re

import msgspec
import pytest

from kvxferd import errors
from kvxferd.api.codec import problem_for
from kvxferd.api.openapi import ERRORS
from kvxferd.client import SidecarError, error_for
from kvxferd.sidecar.peers import _remote_error
from kvxferd.wire import ErrorBody
from tests.api.test_codec import _instance

TREE = errors.tree()
DOCUMENTED_REASONS = re.compile(r"Failed pulls by typed reason \(([^)]*)\)")


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_every_class_carries_an_error_status_and_a_reason_code(cls):
    assert isinstance(cls.status, int) and 400 <= cls.status < 600
    assert re.fullmatch(r"[a-z_]+", cls.code)


def test_the_tree_at_the_top_of_errors_py_shows_each_class_with_its_status_and_code():
    lines = errors.__doc__.splitlines()
    header = next(line for line in lines if line.strip().startswith("class "))
    st, code_at, meaning = header.index("st."), header.index("code"), header.index("meaning")
    rows = {}
    for line in lines[lines.index(header) + 1 :]:
        name = re.search(r"(\w+Error)", line[:st])
        if name is None:
            break
        rows[name[1]] = (line[st:code_at].strip() or None, line[code_at:meaning].strip() or None)
    assert set(rows) == {c.__name__ for c in TREE}
    for cls in TREE:
        status, code = rows[cls.__name__]
        own = cls.__dict__  # an empty cell: inherited from the parent
        assert status == (str(cls.status) if "status" in own else None), cls.__name__
        assert code == (cls.code if "code" in own else None), cls.__name__


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_the_api_codec_answers_the_class_status(cls):
    assert problem_for(_instance(cls)).status == cls.status


def test_openapi_documents_every_status_of_the_tree_naming_its_classes():
    for cls in TREE:
        if issubclass(cls, errors.InvalidRequestError | errors.PoolExhaustedError):
            continue  # the OpenAI-style servers' own (sim), never the sidecar APIs'
        assert cls.__name__ in ERRORS[cls.status][1], cls.__name__


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_the_pull_reason_of_an_error_is_its_class_code(cls):
    assert errors.reason_code(_instance(cls)) == cls.code
    assert errors.reason_code(TimeoutError()) == "deadline"
    assert errors.reason_code(KeyError("x")) == "internal"


def test_every_pull_reason_code_is_documented_for_operators():
    from tests.deploy.readme import README

    documented = DOCUMENTED_REASONS.search(README.read_text(encoding="utf-8"))
    assert documented is not None
    names = {n.strip() for n in documented[1].split(",")}
    assert {c.code for c in TREE} | {"deadline", "internal"} <= names


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_the_client_rebuilds_the_class_from_its_status_and_name(cls):
    exc = _instance(cls)
    body = problem_for(exc).body
    rebuilt = error_for(cls.status, body)
    if not isinstance(rebuilt, SidecarError):  # classes with richer constructors stay generic
        assert type(rebuilt) is cls and rebuilt.status == cls.status
    assert errors.status_of(rebuilt) in (cls.status, SidecarError.status)


@pytest.mark.parametrize(
    "cls",
    [errors.UnknownHoldError, errors.HoldExpiredError, errors.AuthError,
     errors.IncompatiblePeerError, errors.SegmentTooSmallError],
    ids=lambda c: c.__name__,
)  # fmt: skip
@pytest.mark.parametrize("codec", [msgspec.json, msgspec.msgpack], ids=["http", "frames"])
def test_a_peer_answer_becomes_the_class_whose_status_it_carries(cls, codec):
    body = problem_for(_instance(cls)).body
    assert type(_remote_error("127.0.0.1:9", cls.status, codec.encode(body), codec)) is cls


def test_an_error_body_names_the_class():
    body = problem_for(errors.UnknownPullError("no pull")).body
    assert body == ErrorBody(error="UnknownPullError", detail="no pull")


def test_an_incompatible_peer_message_cuts_each_value_it_quotes():
    # The values come from a peer's manifest (a part name is any string) and the message
    # becomes a failed pull's detail, kept and logged.
    exc = errors.IncompatiblePeerError({"groups[0].layers[0].k.name": ("k", "x" * (1 << 20))})
    assert len(str(exc)) < 512
    assert "local='k'" in str(exc) and "remote='xxx" in str(exc)


def test_an_incompatible_peer_message_says_why_where_a_reason_is_given():
    exc = errors.IncompatiblePeerError(
        {"a.head_layout": ("NHD", "NHD"), "b.dtype": ("x", "y")}, {"a.head_layout": "needs HND"}
    )
    assert str(exc) == (
        "incompatible peer: a.head_layout: needs HND, local='NHD' remote='NHD'; "
        "b.dtype: local='x' remote='y'"
    )
    assert exc.reasons == {"a.head_layout": "needs HND"}
