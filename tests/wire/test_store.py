"""Store messages: every chunk key is 32 lowercase hex digits, a call names at most MAX_TOKENS
keys and MAX_GROUPS id lists, and a group lists at most MAX_BLOCK_IDS block ids at decode, each
refusal naming the entry."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.store import chunk_keys
from kvxferd.wire import (
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_TOKENS,
    StoreLoadRequest,
    StoreLookupRequest,
    StoreSaveRequest,
)

_KEY = "0123456789abcdef" * 2
_BODIES = {
    StoreSaveRequest: {"request_id": "r", "block_ids": [[1]]},
    StoreLookupRequest: {"num_tokens": 32},
    StoreLoadRequest: {"block_ids": [[1]], "num_tokens": 32},
}


@pytest.mark.parametrize("kind", list(_BODIES), ids=lambda k: k.__name__)
def test_chunk_keys_as_the_store_makes_them_are_taken(kind):
    keys = chunk_keys(range(32), 16)
    body = msgspec.json.encode({**_BODIES[kind], "keys": keys})
    assert msgspec.json.decode(body, type=kind).keys == keys


@pytest.mark.parametrize("kind", list(_BODIES), ids=lambda k: k.__name__)
@pytest.mark.parametrize(
    "key",
    ["k", _KEY[:-1], _KEY + "0", _KEY.upper(), _KEY[:-1] + "\n", "0" * 1000],
    ids=["short", "31", "33", "upper-case", "newline", "long"],
)
def test_a_key_that_is_not_32_lower_hex_digits_is_refused_and_named(kind, key):
    body = msgspec.json.encode({**_BODIES[kind], "keys": [_KEY, key]})
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.keys\[1\]`$"):
        msgspec.json.decode(body, type=kind)


def test_a_save_names_its_hold_by_a_hold_id_or_leaves_it_empty():
    body = {**_BODIES[StoreSaveRequest], "keys": [_KEY]}
    assert msgspec.json.decode(msgspec.json.encode(body), type=StoreSaveRequest).hold_id == ""
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.hold_id`$"):
        msgspec.json.decode(msgspec.json.encode({**body, "hold_id": "x" * 129}),
                            type=StoreSaveRequest)  # fmt: skip


@pytest.mark.parametrize("kind", [StoreSaveRequest, StoreLoadRequest], ids=lambda k: k.__name__)
def test_a_save_or_load_group_listing_more_than_max_block_ids_is_refused_and_named(kind):
    flood = msgspec.Raw(b"\xdd" + (MAX_BLOCK_IDS + 1).to_bytes(4, "big") + bytes(MAX_BLOCK_IDS + 1))
    body = {**_BODIES[kind], "keys": [_KEY], "block_ids": [[1], flood]}
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.block_ids\[1\]`$"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=kind)


@pytest.mark.parametrize("kind", list(_BODIES), ids=lambda k: k.__name__)
def test_more_keys_than_max_tokens_are_refused_before_any_key_and_named(kind):
    flood = msgspec.Raw(b"\xdd" + (MAX_TOKENS + 1).to_bytes(4, "big"))  # the count alone
    body = msgspec.msgpack.encode({**_BODIES[kind], "keys": flood})
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.keys`$"):
        msgspec.msgpack.decode(body, type=kind)


@pytest.mark.parametrize("kind", [StoreSaveRequest, StoreLoadRequest], ids=lambda k: k.__name__)
def test_a_save_or_load_naming_more_id_lists_than_max_groups_is_refused_and_named(kind):
    body = {**_BODIES[kind], "keys": [_KEY], "block_ids": [[1]] * MAX_GROUPS}
    assert len(msgspec.json.decode(msgspec.json.encode(body), type=kind).block_ids) == MAX_GROUPS
    body["block_ids"] = [[1]] * (MAX_GROUPS + 1)
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.block_ids`$"):
        msgspec.json.decode(msgspec.json.encode(body), type=kind)
