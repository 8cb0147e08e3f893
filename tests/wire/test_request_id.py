"""RequestId: at most 512 characters on one line (no control character but tab, no line
separator), on every request id that comes in (a newline in one would forge a log line; an
unbounded one would grow every table and feed). ``one_line`` escapes the same characters in
text that is logged as it came (a peer's)."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.wire import (
    ONE_LINE_PATTERN,
    FinishedPulls,
    HoldRequest,
    PullRequest,
    ReleasedHolds,
    RequestId,
    StoreLoadRequest,
    StoreSaveRequest,
    Ticket,
    one_line,
)

_TICKET = {
    "engine_id": "e", "epoch": 1, "hold_id": "h", "request_id": "r", "block_ids": [[1]],
    "num_tokens": 1, "expires_at": 0.0, "tp_rank": 0, "tp_size": 1, "peer": "h:1",
}  # fmt: skip
_KEY = "0" * 32


@pytest.mark.parametrize(
    "request_id",
    ["", "r", "x" * 512, "cmpl-\t-0", "caf\u00e9 \u2603\u00a0\u00ff", "chatcmpl-7f3a-0-1b2c"],
    ids=["empty", "one", "512", "tab", "non-ascii", "vllm-style"],
)
def test_a_request_id_of_at_most_512_non_control_characters_is_taken(request_id):
    assert msgspec.convert(request_id, RequestId) == request_id


@pytest.mark.parametrize(
    "request_id",
    ["x" * 513, "r\n", "r\nkvxferd ready", "\n", "r\r", "r\x00", "r\x08", "r\x1b[2J", "r\x7f"]
    + ["r\x85forged", "r\u2028forged", "r\u2029forged", "r\x80", "r\x9b2J", "r\x9f"],
    ids=["513", "trailing-newline", "newline", "only-newline", "cr", "nul", "bs", "esc", "del"]
    + ["nel", "line-separator", "paragraph-separator", "c1-first", "c1-csi", "c1-last"],
)
def test_a_request_id_too_long_or_with_a_control_character_or_line_break_is_refused(request_id):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(request_id, RequestId)


@given(st.text(max_size=40))
def test_text_the_one_line_rule_takes_is_one_line_for_python_and_has_no_control_but_tab(text):
    if re.search(ONE_LINE_PATTERN, text):
        assert len(text.splitlines()) <= 1
        assert all(c == "\t" or (c >= " " and not "\x7f" <= c <= "\x9f") for c in text)


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (HoldRequest, {"block_ids": [[1]], "num_tokens": 1}),
        (Ticket, _TICKET),
        (PullRequest, {"tickets": [_TICKET], "block_ids": [[1]]}),
        (StoreSaveRequest, {"keys": [_KEY], "block_ids": [[1]]}),
        (StoreLoadRequest, {"keys": [_KEY], "block_ids": [[1]], "num_tokens": 1}),
    ],
    ids=["hold", "ticket", "pull", "store-save", "store-load"],
)
@pytest.mark.parametrize("request_id", ["r\n", "x" * 513], ids=["newline", "513"])
def test_every_incoming_request_id_is_checked_and_named(kind, body, request_id):
    raw = msgspec.json.encode({**body, "request_id": request_id})
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.request_id`$"):
        msgspec.json.decode(raw, type=kind)
    assert msgspec.json.decode(msgspec.json.encode({**body, "request_id": "r"}), type=kind)


def test_an_engine_reads_a_feed_page_whatever_request_id_an_older_sidecar_put_in_it():
    """A page that failed to decode would be asked for again, step after step, never read."""
    rid = "r\n" + "x" * 600
    released = {"holds": [{"hold_id": "h", "request_id": rid, "block_ids": [[1]],
                           "reason": "notified"}], "cursor": 1}  # fmt: skip
    page = msgspec.json.decode(msgspec.json.encode(released), type=ReleasedHolds)
    assert page.holds[0].request_id == rid
    finished = {"pulls": [{"pull_id": "p", "request_id": rid, "state": "done"}], "cursor": 1}
    page = msgspec.json.decode(msgspec.json.encode(finished), type=FinishedPulls)
    assert page.pulls[0].request_id == rid


@given(st.text(max_size=40))
def test_one_line_escapes_exactly_the_characters_the_one_line_rule_refuses(text):
    escaped = one_line(text)
    assert re.search(ONE_LINE_PATTERN, escaped)
    want = "".join(c if re.search(ONE_LINE_PATTERN, c) else c.encode("unicode_escape").decode()
                   for c in text)  # fmt: skip
    assert escaped == want
