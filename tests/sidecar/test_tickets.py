"""Tickets are signed over every field but the token; any edit or another secret fails."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.errors import AuthError, ConfigError
from kvxferd.sidecar.tickets import sign_ticket, ticket_mac, verify_ticket
from kvxferd.wire import Ticket

SECRET = b"shared peer secret"


def ticket(**changes):
    fields = dict(
        engine_id="prefill-0",
        epoch=1732200000,
        hold_id="9f2c",
        request_id="req-1",
        block_ids=[[3, 5, 7], [9]],
        num_tokens=40,
        expires_at=1732200030.125,
        tp_rank=1,
        tp_size=2,
        peer="10.0.0.2:7100",
    )
    fields.update(changes)
    return Ticket(**fields)


def test_signed_ticket_verifies_and_survives_a_json_round_trip():
    signed = sign_ticket(ticket(), SECRET)
    assert len(signed.token) == 64 and signed.token == ticket_mac(ticket(), SECRET)
    verify_ticket(signed, SECRET)
    again = msgspec.json.decode(msgspec.json.encode(signed), type=Ticket)
    verify_ticket(again, SECRET)
    # The token itself is not covered: re-signing a signed ticket gives the same token.
    assert sign_ticket(signed, SECRET).token == signed.token


@pytest.mark.parametrize(
    "edit",
    [
        dict(block_ids=[[3, 5, 8], [9]]),
        dict(block_ids=[[3, 5, 7], []]),
        dict(expires_at=1732200030.126),
        dict(expires_at=1e12),
        dict(peer="10.0.0.66:7100"),
        dict(peer="10.0.0.2:7101"),
        dict(tp_rank=0),
        dict(hold_id="9f2d"),
        dict(engine_id="prefill-1"),
        dict(epoch=1732200001),
        dict(request_id="req-2"),
        dict(num_tokens=41),
        dict(tp_size=1),
    ],
)
def test_any_edited_field_fails(edit):
    signed = sign_ticket(ticket(), SECRET)
    tampered = msgspec.structs.replace(signed, **edit)
    with pytest.raises(AuthError, match="ticket.token"):
        verify_ticket(tampered, SECRET)


def test_wrong_secret_missing_or_garbage_token_fail():
    signed = sign_ticket(ticket(), SECRET)
    with pytest.raises(AuthError, match="does not match"):
        verify_ticket(signed, b"another secret")
    with pytest.raises(AuthError, match="missing"):
        verify_ticket(ticket(), SECRET)
    for token in ("00" * 32, signed.token.upper(), signed.token[:-1], "é" * 64):
        with pytest.raises(AuthError):
            verify_ticket(msgspec.structs.replace(signed, token=token), SECRET)


def test_an_empty_secret_is_a_configuration_error():
    with pytest.raises(ConfigError, match="secret"):
        sign_ticket(ticket(), b"")
    with pytest.raises(ConfigError, match="secret"):
        verify_ticket(sign_ticket(ticket(), SECRET), b"")
