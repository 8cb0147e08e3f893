"""What the engine API tests share: the ErrorBody of an answer, and a hold's body."""

from __future__ import annotations

import uuid

import msgspec

from kvxferd.wire import ErrorBody


def error_of(resp, status: int) -> ErrorBody:
    """The ErrorBody of an answer that must have ``status``; the field is named at most once."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = msgspec.json.decode(resp.content, type=ErrorBody)
    assert f"{body.field}: {body.field}" not in body.detail or not body.field, body.detail
    if body.field and "," not in body.field:  # one field: the detail starts with it, once
        assert body.detail.startswith(f"{body.field}: "), body.detail
    return body


def hold_body(**changes) -> dict:
    body = {"request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": [[1, 2]], "num_tokens": 20}
    return {**body, **changes}
