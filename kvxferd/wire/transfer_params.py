"""``kv_transfer_params``: vLLM's P/D protocol object, plus our tickets.

A proxy sends a prefill ``{"do_remote_decode": true, ...}``; the prefill answers with
``do_remote_prefill: true``, the remote block ids per group, where its rank-0 sidecar is, its
TP size and ``kvxferd_tickets`` (one signed Ticket per prefill rank, in rank order; one alone,
``ranks`` = TP size, from a prefill pod sidecar), which the
proxy hands to a decode unchanged. Anyone who can reach a decode's OpenAI port can send these
params, so every field is checked before it is acted on (the simulator and the vLLM connector
read them with the functions here).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from kvxferd.errors import InvalidRequestError
from kvxferd.wire.engine import MAX_TP, Ticket
from kvxferd.wire.manifest import one_line

FIELD = "kv_transfer_params"
_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def wants_remote_decode(params: Any) -> bool:
    """A prefill request: the decode will happen elsewhere and pull our blocks."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def has_remote_prefill(params: Any) -> bool:
    """A decode request whose KV is to be pulled from a prefill."""
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def parse_tickets(params: dict[str, Any]) -> list[Ticket]:
    """The prefill's tickets (InvalidRequestError naming the field when missing or malformed)."""
    field = f"{FIELD}.kvxferd_tickets"
    raw = params.get("kvxferd_tickets")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError(
            field, "missing: a list of tickets from a kvxferd prefill is required to pull"
        )
    if len(raw) > MAX_TP:  # before any ticket is converted
        raise InvalidRequestError(
            field, f"{len(raw)} tickets; at most {MAX_TP} (one per prefill rank)"
        )
    try:
        tickets = msgspec.convert(raw, list[Ticket])
    except msgspec.ValidationError as exc:
        match = _AT.match(one_line(str(exc)))  # an unknown field's name is the sender's text
        assert match is not None
        raise InvalidRequestError(field + (match["path"] or ""), match["message"]) from exc
    if len(tickets) == 1 and tickets[0].ranks > 1:  # a pod sidecar's one ticket
        t = tickets[0]
        if t.tp_rank != 0 or t.tp_size != t.ranks:
            raise InvalidRequestError(
                f"{field}[0]", f"rank {t.tp_rank} of {t.tp_size} spanning {t.ranks} ranks, "
                "expected rank 0 of all the ranks it spans (a prefill pod's one ticket)",
            )  # fmt: skip
        return tickets
    for i, t in enumerate(tickets):
        if t.ranks != 1:
            raise InvalidRequestError(
                f"{field}[{i}].ranks", f"{t.ranks}: a prefill pod's ticket spans every rank and "
                "comes alone",
            )  # fmt: skip
        if t.tp_rank != i or t.tp_size != len(tickets):
            raise InvalidRequestError(
                f"{field}[{i}]", f"rank {t.tp_rank} of {t.tp_size}, expected rank {i} of "
                f"{len(tickets)} (one ticket per prefill rank, rank order)",
            )  # fmt: skip
    return tickets


def int_field(params: dict[str, Any], name: str, default: int, *, low: int, high: int) -> int:
    """Integer field ``name`` of the params, in ``[low, high]`` (``default`` when absent);
    InvalidRequestError naming it otherwise (a bool is not an integer here)."""
    value = params.get(name, default)
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequestError(
            f"{FIELD}.{name}", f"expected an integer in [{low}, {high}], got {value!r:.40}"
        )
    return value


def prefill_answer(
    *, engine_id: str, request_id: str, peer: str, tickets: list[Ticket]
) -> dict[str, Any]:
    """What a prefill returns for the proxy to forward to a decode."""
    host, _, port = peer.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": tickets[0].block_ids,
        "remote_host": host,
        "remote_port": int(port),
        "remote_request_id": request_id,
        "tp_size": len(tickets),
        "kvxferd_tickets": msgspec.to_builtins(tickets),
    }
