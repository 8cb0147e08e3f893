"""Every wire type of kvxferd, as msgspec Structs, in one place.

The KV manifest (:mod:`~kvxferd.wire.manifest`) is the centre: an engine hands it to its sidecar
at registration, and two sidecars exchange it at handshake. Everything the data plane does is a
pure function of it.

Schema rules (msgspec's schema-evolution guidance): new fields get defaults; field types never
change; map encoding, never ``array_like``. Structs received from engines are strict
(``forbid_unknown_fields``); the manifest is also sent between peers of possibly different
versions, where ``MANIFEST_VERSION`` is checked before anything else.

Byte addressing used throughout: a *block unit* is a kernel block for attention parts and a
logical block for mamba parts. Part ``p`` of block unit ``u`` starts at
``region_base + p.offset + u * p.block_stride``; within it, TP unit ``i`` (a head, group or
channel this rank holds) occupies ``[i * p.unit_stride, i * p.unit_stride + p.unit_bytes)``,
repeated ``p.rows`` times ``p.row_stride`` apart (rows > 1 only for vLLM's packed K|V rows).

Modules: :mod:`~kvxferd.wire.manifest` (the manifest), :mod:`~kvxferd.wire.engine` (the engine
API), :mod:`~kvxferd.wire.store` (the engine API's store calls), :mod:`~kvxferd.wire.peer` (the
peer API). Import from ``kvxferd.wire``: every type is re-exported here.
:mod:`~kvxferd.wire.transfer_params` reads vLLM's ``kv_transfer_params`` (which carry our tickets)
with every field checked.
"""

from __future__ import annotations

from kvxferd.wire.engine import (
    DECLINE_REASON_MAX_LENGTH,
    HOLD_SPARE_BLOCKS,
    MAX_BLOCK_IDS,
    MAX_TICKETS_PER_CALL,
    MAX_TOKENS,
    MAX_TP,
    PEER_ADDRESS_PATTERN,
    PEER_HOST_PATTERN,
    PROTOCOL_VERSION,
    AbortHoldRequest,
    AnyRegionSpec,
    CudaRegionSpec,
    DeclineRequest,
    FinishedPull,
    FinishedPulls,
    HoldReleaseReason,
    HoldRequest,
    Identity,
    KeepaliveRequest,
    PullAccepted,
    PullRequest,
    PullStateName,
    PullStatus,
    RegionSpec,
    RegisterRequest,
    RegisterResponse,
    ReleasedHold,
    ReleasedHolds,
    Ticket,
    UnregisterRequest,
)
from kvxferd.wire.frames import FrameAnswer, FrameRequest
from kvxferd.wire.manifest import (
    DTYPE_BYTES,
    ENGINE_ID_PATTERN,
    HOLD_ID_PATTERN,
    MANIFEST_VERSION,
    ONE_LINE_PATTERN,
    REQUEST_ID_MAX_LENGTH,
    AttentionLayer,
    ConvLayout,
    Dtype,
    EngineId,
    Group,
    GroupKind,
    HeadLayout,
    HoldId,
    KVOrder,
    Layer,
    MambaLayer,
    MambaType,
    Manifest,
    MemType,
    Part,
    PoolLayout,
    Region,
    RequestId,
    decode_manifest,
    encode_manifest,
    manifest_decoder,
    manifest_encoder,
    one_line,
)
from kvxferd.wire.peer import (
    ClaimRequest,
    ClaimResponse,
    DeclineResponse,
    ErrorBody,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
)
from kvxferd.wire.store import (
    STORE_KEY_HEX,
    STORE_KEY_PATTERN,
    StoreLoadRequest,
    StoreLoadStatus,
    StoreLookup,
    StoreLookupRequest,
    StoreSaved,
    StoreSaveRequest,
)

__all__ = [
    "AbortHoldRequest",
    "AnyRegionSpec",
    "AttentionLayer",
    "ClaimRequest",
    "ClaimResponse",
    "ConvLayout",
    "CudaRegionSpec",
    "DECLINE_REASON_MAX_LENGTH",
    "DTYPE_BYTES",
    "DeclineRequest",
    "DeclineResponse",
    "Dtype",
    "ENGINE_ID_PATTERN",
    "EngineId",
    "ErrorBody",
    "FrameAnswer",
    "FrameRequest",
    "FinishedPull",
    "FinishedPulls",
    "Group",
    "GroupKind",
    "Handshake",
    "HeadLayout",
    "Heartbeat",
    "HeartbeatResponse",
    "HOLD_ID_PATTERN",
    "HOLD_SPARE_BLOCKS",
    "HoldId",
    "HoldReleaseReason",
    "HoldRequest",
    "Identity",
    "KVOrder",
    "KeepaliveRequest",
    "Layer",
    "MANIFEST_VERSION",
    "MAX_BLOCK_IDS",
    "MAX_TICKETS_PER_CALL",
    "MAX_TOKENS",
    "MAX_TP",
    "MambaLayer",
    "MambaType",
    "Manifest",
    "MemType",
    "ONE_LINE_PATTERN",
    "PEER_ADDRESS_PATTERN",
    "PEER_HOST_PATTERN",
    "PROTOCOL_VERSION",
    "Part",
    "PoolLayout",
    "PullAccepted",
    "PullRequest",
    "PullStateName",
    "PullStatus",
    "REQUEST_ID_MAX_LENGTH",
    "Region",
    "RegionSpec",
    "RegisterRequest",
    "RegisterResponse",
    "ReleasedHold",
    "ReleasedHolds",
    "RequestId",
    "STORE_KEY_HEX",
    "STORE_KEY_PATTERN",
    "StoreLoadRequest",
    "StoreLoadStatus",
    "StoreLookup",
    "StoreLookupRequest",
    "StoreSaveRequest",
    "StoreSaved",
    "Ticket",
    "UnregisterRequest",
    "decode_manifest",
    "encode_manifest",
    "manifest_decoder",
    "manifest_encoder",
    "one_line",
]
