"""The peer API's messages (TCP, signed, sidecar to sidecar)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvxferd.wire.engine import MAX_TICKETS_PER_CALL, MAX_TP, Ticket
from kvxferd.wire.manifest import _POSITIVE, MAX_REGIONS, EngineId, HoldId, Manifest

HoldIdsAnswered = Annotated[list[str], msgspec.Meta(max_length=MAX_TICKETS_PER_CALL)]
"""Hold ids a heartbeat or decline answer names in one of its lists: at most the holds the call
asked about (MAX_TICKETS_PER_CALL); a prefill side's longer answer is an invalid one."""


class RankLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One more TP rank of a pod sidecar: its manifest and where its regions lie."""

    manifest: Manifest
    """That rank's KV manifest (``tp_rank`` names the rank)."""
    region_bases: Annotated[list[int], msgspec.Meta(max_length=MAX_REGIONS)]
    """Base address of each of its manifest regions in the sender's process."""


class Handshake(msgspec.Struct, frozen=True, kw_only=True):
    """Exchanged both ways on first contact (per engine id + epoch); lenient to new fields."""

    protocol_version: int
    """PROTOCOL_VERSION of the sender."""
    engine_id: EngineId
    """Sender's engine identity (1-128 printable ASCII characters, no space)."""
    epoch: int
    """Sender's boot epoch."""
    agent_name: str
    """Sender's NIXL agent name."""
    agent_metadata: bytes
    """Sender's NIXL agent metadata (base64 in JSON)."""
    manifest: Manifest
    """Sender's KV manifest."""
    region_bases: Annotated[list[int], msgspec.Meta(max_length=MAX_REGIONS)]
    """Base address of each manifest region in the sender's process (for READ descriptors; at
    most MAX_REGIONS)."""
    frames_port: int = 0
    """TCP port of the sender's framed peer API on its peer host (claims, heartbeats, declines);
    0: none, call it over HTTP."""
    tcp_tx_seg_bytes: int = 0
    """Bytes per UCX TCP segment the sender's agent sends (UCX_TCP_TX_SEG_SIZE); 0: not stated."""
    tcp_rx_seg_bytes: int = 0
    """Bytes per UCX TCP segment the sender's agent receives (UCX_TCP_RX_SEG_SIZE); 0: not
    stated. A reader must receive at least what its target sends, or READs over TCP fail."""
    generation: int = -1
    """The sender's registration generation: its manifest, region bases and agent metadata are
    that registration's (an engine registering again changes them; a reader handshakes again
    for a ticket of another generation). -1: not stated (an older sidecar)."""
    pod: Annotated[list[RankLayout], msgspec.Meta(max_length=MAX_TP - 1)] = []
    """A pod sidecar's other ranks, ``tp_rank`` 1 up, in order (``manifest`` and
    ``region_bases`` above are rank 0's); empty: the sender serves one rank."""


class ClaimRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Decode sidecar -> prefill sidecar: pin a hold while I read it."""

    ticket: Ticket
    """The ticket (its HMAC is checked)."""
    reader: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    """The reader's agent name (the notification will come from it; 1-256 characters)."""
    reader_tp_size: int
    """Decode TP size: how many decode ranks may read this prefill rank follows from it."""
    claim_s: float
    """How long the claim pins the hold."""


class ClaimResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Claim granted."""

    hold_id: str
    """The hold."""
    expires_at: float
    """Unix time the claim ends."""
    expected_readers: int
    """Notifications the prefill side waits for before releasing."""
    claim_s: float = 0.0
    """Seconds the claim pins the hold from when it was granted (the request's ``claim_s``, cut
    to the prefill side's cap and never past what the hold allows): the reader's READs must
    end within this time, counted from when it sent the claim (0: an older peer, unknown)."""


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """Decode side -> prefill side: keep these holds alive (requests still queued)."""

    hold_ids: Annotated[list[HoldId], msgspec.Meta(max_length=MAX_TICKETS_PER_CALL)]
    """Holds to extend (at most MAX_TICKETS_PER_CALL: a keepalive's tickets at one peer)."""
    extend_s: Annotated[float, msgspec.Meta(extra_json_schema=_POSITIVE)]
    """Seconds to extend each lease by (capped by the prefill side)."""


class HeartbeatResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Which holds were extended and which are gone (at most MAX_TICKETS_PER_CALL a list)."""

    extended: HoldIdsAnswered
    """Holds whose lease was extended."""
    missing: HoldIdsAnswered
    """Holds that no longer exist (expired or released)."""
    unanswered: HoldIdsAnswered = []
    """Holds whose prefill sidecar gave no usable answer (unreachable, timed out, refused), so
    their lease is unknown; only a decode sidecar's keepalive answer has any."""


class DeclineResponse(msgspec.Struct, frozen=True, kw_only=True):
    """What a decline did to each hold (the engine API merges every prefill side's answer; each
    list at most MAX_TICKETS_PER_CALL)."""

    released: HoldIdsAnswered
    """Holds released now, reason ``declined``."""
    missing: HoldIdsAnswered
    """Holds that were already gone (released, expired) or do not match their ticket."""
    busy: HoldIdsAnswered = []
    """Holds a reader has claimed and may be reading: left to its notification or expiry."""
    unanswered: HoldIdsAnswered = []
    """Holds whose prefill sidecar gave no usable answer (they expire with their lease)."""


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """Body of every 4xx/5xx answer of both APIs."""

    error: str
    """Error class, e.g. BlockIdError."""
    detail: str
    """Human-readable message."""
    field: str = ""
    """The offending request field, when one is to blame."""
    not_before: int = 0
    """A 401 SignedBeforeStartError's: the earliest signed ``ts`` (Unix s) this sidecar accepts
    since it started; sign the request again with a ts at least this (0: not such a 401)."""
