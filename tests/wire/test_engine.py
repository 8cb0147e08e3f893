"""Engine API messages: hold ids, a ticket's peer, token and token count, the ticket lists of
declines and keepalives, the id lists per group and every group's block ids, and a registration's
memory sources are bounded and shaped at decode (they go into tables, logs, a URL, an HTTP Host
header and calls to peers), and refusals name the field."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.wire import (
    HOLD_SPARE_BLOCKS,
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_REGIONS,
    MAX_TICKETS_PER_CALL,
    MAX_TOKENS,
    MAX_TP,
    AbortHoldRequest,
    DeclineRequest,
    HoldRequest,
    Identity,
    KeepaliveRequest,
    PullRequest,
    RegisterRequest,
    Ticket,
)

_TICKET = {
    "engine_id": "e", "epoch": 1, "hold_id": "h", "request_id": "r", "block_ids": [[1]],
    "num_tokens": 1, "expires_at": 0.0, "tp_rank": 0, "tp_size": 1, "peer": "h:1",
}  # fmt: skip
_HOLD = {"request_id": "r", "block_ids": [[1]], "num_tokens": 1}
_BAD_HOLD_IDS = ["x" * 129, "a b", "h\n", "h\r\nX: y", "h/../x", "caf\u00e9"]
_BAD_IDS = ["129", "space", "trailing-newline", "crlf", "slash", "non-ascii"]


def _decode(kind: type, body: dict):
    return msgspec.json.decode(msgspec.json.encode(body), type=kind)


def _refused_at(kind: type, body: dict, path: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=rf"at `\$\.{path}`$"):
        _decode(kind, body)


@pytest.mark.parametrize("hold_id", ["h", "0123456789abcdef" * 2, "x" * 128, "req-1.a_b:c"])
def test_a_hold_id_of_1_to_128_safe_characters_is_taken_everywhere(hold_id):
    assert _decode(HoldRequest, {**_HOLD, "hold_id": hold_id}).hold_id == hold_id
    assert _decode(Ticket, {**_TICKET, "hold_id": hold_id}).hold_id == hold_id
    assert _decode(AbortHoldRequest, {"hold_id": hold_id}).hold_id == hold_id


@pytest.mark.parametrize("hold_id", _BAD_HOLD_IDS, ids=_BAD_IDS)
def test_a_hold_id_too_long_or_with_other_characters_is_refused_and_named(hold_id):
    _refused_at(HoldRequest, {**_HOLD, "hold_id": hold_id}, "hold_id")
    _refused_at(Ticket, {**_TICKET, "hold_id": hold_id}, "hold_id")
    _refused_at(AbortHoldRequest, {"hold_id": hold_id}, "hold_id")


def test_only_a_hold_request_may_leave_the_hold_id_empty():
    assert _decode(HoldRequest, _HOLD).hold_id == ""  # the sidecar picks one
    _refused_at(Ticket, {**_TICKET, "hold_id": ""}, "hold_id")
    _refused_at(AbortHoldRequest, {"hold_id": ""}, "hold_id")


@pytest.mark.parametrize(
    "peer",
    ["127.0.0.1:7100", "pod-0.kv.svc.cluster.local:7100", "[::1]:7100", "::1:7100",
     "[fe80::1%eth0]:1", "h" * 255 + ":65535"],
    ids=["ipv4", "dns", "ipv6", "bare-ipv6", "zone", "longest"],
)  # fmt: skip
def test_a_ticket_names_its_peer_as_host_colon_port(peer):
    assert _decode(Ticket, {**_TICKET, "peer": peer}).peer == peer


@pytest.mark.parametrize(
    "peer",
    ["", "h", "h:", ":1", "h:123456", "h:port", "a b:1", "h:1\n", "h\r\nX: y:1",
     "h/x:1", "h@x:1", "h" * 256 + ":1"],
    ids=["empty", "no-port", "empty-port", "no-host", "port-too-long", "port-not-digits",
         "space", "trailing-newline", "header-injection", "slash", "userinfo", "host-too-long"],
)  # fmt: skip
def test_a_ticket_whose_peer_is_not_host_colon_port_is_refused_and_named(peer):
    _refused_at(Ticket, {**_TICKET, "peer": peer}, "peer")


@pytest.mark.parametrize("token", ["", "0f" * 32], ids=["unsigned", "hmac-sha256"])
def test_a_ticket_token_is_at_most_64_hex_digits(token):
    assert _decode(Ticket, {**_TICKET, "token": token}).token == token


@pytest.mark.parametrize(
    "token",
    ["0" * 65, "0" * 64 + "\n", "0F" * 32, "z" * 64],
    ids=["65", "trailing-newline", "upper-case", "not-hex"],
)
def test_a_ticket_token_longer_or_not_lower_hex_is_refused_and_named(token):
    _refused_at(Ticket, {**_TICKET, "token": token}, "token")


@pytest.mark.parametrize("num_tokens", [0, 1, MAX_TOKENS])
def test_a_ticket_covers_0_to_max_tokens(num_tokens):
    assert _decode(Ticket, {**_TICKET, "num_tokens": num_tokens}).num_tokens == num_tokens


@pytest.mark.parametrize(
    "num_tokens", [-1, MAX_TOKENS + 1, 1 << 63], ids=["negative", "past-max", "int64"]
)
def test_a_ticket_past_max_tokens_or_negative_is_refused_and_named(num_tokens):
    _refused_at(Ticket, {**_TICKET, "num_tokens": num_tokens}, "num_tokens")
    _refused_at(DeclineRequest, {"tickets": [{**_TICKET, "num_tokens": num_tokens}]},
                r"tickets\[0\]\.num_tokens")  # fmt: skip


@pytest.mark.parametrize("kind,extra", [(DeclineRequest, {}), (KeepaliveRequest, {"extend_s": 1})])
def test_a_decline_or_keepalive_carries_at_most_max_tickets_per_call(kind, extra):
    most = [_TICKET] * MAX_TICKETS_PER_CALL
    assert len(_decode(kind, {"tickets": most, **extra}).tickets) == MAX_TICKETS_PER_CALL
    _refused_at(kind, {"tickets": [*most, _TICKET], **extra}, "tickets")


@pytest.mark.parametrize(
    ("field", "value"), [("tp_size", 0), ("tp_size", MAX_TP + 1), ("tp_rank", -1),
                         ("tp_rank", MAX_TP)],
)  # fmt: skip
def test_a_ticket_names_a_tp_rank_and_size_within_max_tp(field, value):
    _refused_at(Ticket, {**_TICKET, field: value}, field)


def test_a_pull_carries_at_most_max_tp_tickets():
    most = {"tickets": [_TICKET] * MAX_TP, "block_ids": [[1]]}
    assert len(_decode(PullRequest, most).tickets) == MAX_TP
    _refused_at(PullRequest, {**most, "tickets": [_TICKET] * (MAX_TP + 1)}, "tickets")


def _zeros(n: int) -> msgspec.Raw:
    """A msgpack array of ``n`` zero ids, written without building the list."""
    return msgspec.Raw(b"\xdd" + n.to_bytes(4, "big") + bytes(n))


def _with_ids(kind: type, ids: msgspec.Raw) -> tuple[dict, str]:
    """A body of ``kind`` whose second group lists ``ids``, and that list's path."""
    ticket = {**_TICKET, "block_ids": [[1], ids]}
    return {
        Ticket: (ticket, "block_ids[1]"),
        HoldRequest: ({**_HOLD, "block_ids": [[1], ids]}, "block_ids[1]"),
        PullRequest: ({"tickets": [_TICKET], "block_ids": [[1], ids]}, "block_ids[1]"),
        DeclineRequest: ({"tickets": [_TICKET, ticket]}, "tickets[1].block_ids[1]"),
        KeepaliveRequest: ({"tickets": [ticket], "extend_s": 1}, "tickets[0].block_ids[1]"),
    }[kind]


_ID_LISTS = [Ticket, HoldRequest, PullRequest, DeclineRequest, KeepaliveRequest]


@pytest.mark.parametrize("kind", _ID_LISTS, ids=lambda k: k.__name__)
def test_a_group_listing_more_than_max_block_ids_is_refused_before_its_ids_and_named(kind):
    body, path = _with_ids(kind, _zeros(MAX_BLOCK_IDS + 1))
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=kind)
    assert str(err.value).endswith(f"at `$.{path}`")


def test_a_group_may_list_max_block_ids():
    """The blocks MAX_TOKENS tokens span at one token a block, plus the lookahead spare."""
    assert MAX_BLOCK_IDS == MAX_TOKENS + HOLD_SPARE_BLOCKS
    body, _ = _with_ids(Ticket, _zeros(MAX_BLOCK_IDS))
    ticket = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=Ticket)
    assert len(ticket.block_ids[1]) == MAX_BLOCK_IDS


def _with_groups(kind: type, n: int) -> tuple[dict, str]:
    """A body of ``kind`` naming ``n`` id lists (one per group), and that list's path."""
    groups = [[1]] * n
    ticket = {**_TICKET, "block_ids": groups}
    return {
        Ticket: (ticket, "block_ids"),
        HoldRequest: ({**_HOLD, "block_ids": groups}, "block_ids"),
        PullRequest: ({"tickets": [_TICKET], "block_ids": groups}, "block_ids"),
        DeclineRequest: ({"tickets": [_TICKET, ticket]}, "tickets[1].block_ids"),
        KeepaliveRequest: ({"tickets": [ticket], "extend_s": 1}, "tickets[0].block_ids"),
    }[kind]


@pytest.mark.parametrize("kind", _ID_LISTS, ids=lambda k: k.__name__)
def test_more_id_lists_than_max_groups_are_refused_before_any_list_and_named(kind):
    body, path = _with_groups(kind, MAX_GROUPS + 1)
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=kind)
    assert str(err.value) == f"Expected `array` of length <= {MAX_GROUPS} - at `$.{path}`"
    _refused_at(kind, body, path.replace("[", r"\[").replace("]", r"\]"))  # JSON alike


@pytest.mark.parametrize("kind", _ID_LISTS, ids=lambda k: k.__name__)
def test_a_call_may_name_max_groups_id_lists(kind):
    body, _ = _with_groups(kind, MAX_GROUPS)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=kind)


def test_a_registration_names_at_most_max_regions_memory_sources():
    spec = {"type": "shm", "name": "seg", "size_bytes": 1}
    body = {"manifest": {"model": "m", "num_blocks": 1, "regions": [], "groups": []},
            "regions": [spec] * MAX_REGIONS}  # fmt: skip
    assert len(_decode(RegisterRequest, body).regions) == MAX_REGIONS
    _refused_at(RegisterRequest, {**body, "regions": [spec] * (MAX_REGIONS + 1)}, "regions")


_IDENTITY = {"engine_id": "e", "epoch": 1, "generation": 0, "peer_address": "h:1", "tp_rank": 0,
             "tp_size": 1, "default_lease_s": 30.0}  # fmt: skip


def test_an_identity_is_read_whatever_release_of_sidecar_sent_it():
    """A connector reads any sidecar's identity, so it can say the two releases differ instead
    of failing on a field it does not know: a newer sidecar's extra fields are ignored, an older
    one's missing version reads 0."""
    newer = msgspec.json.encode({**_IDENTITY, "engine_api_version": 9, "shiny_new_field": [1]})
    assert msgspec.json.decode(newer, type=Identity).engine_api_version == 9
    older = msgspec.json.decode(msgspec.json.encode(_IDENTITY), type=Identity)
    assert (older.engine_api_version, older.kvxferd_version) == (0, "")
