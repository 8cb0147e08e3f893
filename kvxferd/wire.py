"""Every wire type of kvxferd, as msgspec Structs, in one place.

The KV manifest (below) is the centre: an engine hands it to its sidecar at registration, and two
sidecars exchange it at handshake. Everything the data plane does is a pure function of it.

Schema rules (msgspec's schema-evolution guidance): new fields get defaults; field types never
change; map encoding, never ``array_like``. Structs received from engines are strict
(``forbid_unknown_fields``); the manifest is also sent between peers of possibly different
versions, where ``MANIFEST_VERSION`` is checked before anything else.

Byte addressing used throughout: a *block unit* is a kernel block for attention parts and a
logical block for mamba parts. Part ``p`` of block unit ``u`` starts at
``region_base + p.offset + u * p.block_stride``; within it, TP unit ``i`` (a head, group or
channel this rank holds) occupies ``[i * p.unit_stride, i * p.unit_stride + p.unit_bytes)``,
repeated ``p.rows`` times ``p.row_stride`` apart (rows > 1 only for vLLM's packed K|V rows).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

_POSITIVE = {"exclusiveMinimum": 0}
"""Schema-only constraints (``extra_json_schema``) document what the sidecar checks itself, so
its answer keeps naming the field with the error class it always used (HoldRequestError, ...)."""

MANIFEST_VERSION = 1
"""Bump when the manifest's meaning changes. 1: first version."""

Dtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

MemType = Literal["DRAM", "VRAM"]
GroupKind = Literal["full_attention", "sliding_window", "mamba"]
HeadLayout = Literal["NHD", "HND"]
KVOrder = Literal["kv_first", "blocks_first"]
ConvLayout = Literal["SD", "DS"]
MambaType = Literal["mamba1", "mamba2", "gdn"]
PoolLayout = Literal["per_layer", "cross_layer"]


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the manifest Structs: immutable, keyword-only, typos rejected."""


class Part(_Strict, kw_only=True):
    """One piece of one layer's per-block data (K, V, a conv section, the SSM state).

    A part repeats once per block unit. Inside one block unit it holds ``units`` TP units (heads,
    head groups or channels) of ``unit_bytes`` each, ``unit_stride`` apart; when
    ``unit_stride == unit_bytes`` the part is one contiguous run of ``units * unit_bytes``.
    """

    name: str
    """What the part is: ``k``, ``v``, ``conv``, ``conv_x``, ``conv_b``, ``conv_c``, ``ssm``..."""
    offset: int
    """Bytes from the region base to this part in block unit 0."""
    block_stride: int
    """Bytes between this part in consecutive block units."""
    units: int
    """TP units (heads, groups, channels) this rank holds in this part."""
    unit_bytes: int
    """Bytes of one TP unit in one block unit."""
    unit_stride: int
    """Bytes between consecutive TP units inside one block unit (== unit_bytes if contiguous)."""
    units_total: int
    """TP units of this part across all ranks, before any replication."""
    sliceable: bool = True
    """Whether a rank may read a subset of the units (False for NHD K/V and unsectioned conv)."""
    rows: int = 1
    """Runs per TP unit: a unit is ``rows`` runs of ``unit_bytes``, ``row_stride`` apart (vLLM
    packs K|V per token, so a head's K is one run per token; an SD conv section is one run per
    conv row); 1: one run."""
    row_stride: int = 0
    """Bytes between consecutive runs of one TP unit (unused when ``rows == 1``)."""


class AttentionLayer(_Strict, kw_only=True, tag="attention"):
    """Where one attention layer's K and V live, and their head geometry (per rank)."""

    name: str
    """Layer name, e.g. ``model.layers.3.self_attn``."""
    index: int
    """Layer index in the model (0-based)."""
    region: int
    """Index into ``Manifest.regions`` of the pooled tensor that holds this layer."""
    num_kv_heads: int
    """KV heads this rank holds (replicated when tp_size > total heads)."""
    total_kv_heads: int
    """KV heads of the model."""
    head_size: int
    """Elements per head."""
    dtype: Dtype
    """KV cache element type."""
    head_layout: HeadLayout
    """NHD (tokens outer) or HND (heads outer; each head's tokens contiguous)."""
    kv_order: KVOrder
    """kv_first: all K blocks then all V blocks; blocks_first: per kernel block [K | V]."""
    pack_index: int = 0
    """Slot of this layer in its page when several attention layers share one (seed 000)."""
    k: Part
    """The K part."""
    v: Part
    """The V part."""
    head_size_v: int = 0
    """Elements per V head when it differs from ``head_size`` (0: the same)."""


class MambaLayer(_Strict, kw_only=True, tag="mamba"):
    """Where one Mamba/GDN layer's conv and SSM state live inside a page (unpadded)."""

    name: str
    """Layer name, e.g. ``model.layers.0.mixer``."""
    index: int
    """Layer index in the model (0-based)."""
    region: int
    """Index into ``Manifest.regions`` of the pooled tensor that holds this layer."""
    mamba_type: MambaType
    """Which mixer: mamba1, mamba2 or gated delta net."""
    conv_shape: list[int]
    """Conv state shape per rank, in ``conv_layout`` order."""
    conv_dtype: Dtype
    """Conv state element type."""
    ssm_shape: list[int]
    """SSM (temporal) state shape per rank."""
    ssm_dtype: Dtype
    """SSM state element type."""
    conv_layout: ConvLayout
    """SD: (state_len, dim); DS: (dim, state_len), so x/B/C (or q/k/v) sections are contiguous."""
    conv: list[Part]
    """Conv parts: one per section (x, B, C / q, k, v; SD: one run per conv row), or a single
    unsliceable part when the sections are unknown."""
    ssm: Part
    """The SSM state part."""


Layer = AttentionLayer | MambaLayer


class Group(_Strict, kw_only=True):
    """One KV-cache group: layers that share a block table (one per group in the engine)."""

    kind: GroupKind
    """full_attention, sliding_window or mamba."""
    block_size: int
    """Tokens per logical block (the id the engine's block table holds)."""
    kernel_block_size: int
    """Tokens per kernel block; attention blocks split into block_size // kernel_block_size."""
    layers: list[Layer]
    """The group's layers, ``layers[i]`` living in pooled region ``layers[i].region``."""
    sliding_window: int | None = None
    """Window in tokens, for sliding_window groups."""


class Region(_Strict, kw_only=True):
    """One pooled memory tensor, registered with NIXL once."""

    name: str
    """Stable name; for DRAM regions the POSIX shared-memory segment name."""
    size_bytes: int
    """Bytes of the region."""
    num_blocks: int
    """Logical blocks in the region (shared block-id space of all groups)."""
    page_bytes: int
    """Bytes per logical block (the block stride of hybrid pages)."""
    mem: MemType = "DRAM"
    """DRAM (shared memory) or VRAM (CUDA IPC)."""
    device_id: int = 0
    """GPU index for VRAM; 0 for DRAM."""
    source: int = -1
    """Index into ``RegisterRequest.regions`` of the allocation this region lives in; -1: the
    source at this region's own index (one allocation per region)."""
    source_offset: int = 0
    """Bytes from the start of that allocation to this region (vLLM: one backing buffer per
    worker, many regions inside it)."""


class Manifest(_Strict, kw_only=True):
    """An engine rank's KV-cache layout: identity, pooled regions and groups."""

    model: str
    """Model name or architecture, informational."""
    num_blocks: int
    """Logical block ids are 0..num_blocks-1, shared by all groups (vLLM's one block pool)."""
    regions: list[Region]
    """Pooled tensors, each registered once."""
    groups: list[Group]
    """KV-cache groups in engine order."""
    tp_rank: int = 0
    """This rank's tensor-parallel index."""
    tp_size: int = 1
    """Tensor-parallel world size of the engine."""
    layout: PoolLayout = "per_layer"
    """per_layer: a tensor per layer slot; cross_layer: a tensor per page-size group (seed 001)."""
    attn_pack_size: int = 1
    """Attention layers sharing one page (seed 000)."""
    engine_id: str = ""
    """Engine identity, set by the sidecar at registration."""
    epoch: int = 0
    """Boot epoch of the engine/sidecar; a restart gets a new one."""
    version: int = MANIFEST_VERSION
    """Manifest format version."""


manifest_encoder = msgspec.json.Encoder()
manifest_decoder = msgspec.json.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    """JSON bytes of a manifest."""
    return manifest_encoder.encode(manifest)


def decode_manifest(data: bytes | str) -> Manifest:
    """Parse and type-check a manifest (raises ``msgspec.ValidationError``)."""
    return manifest_decoder.decode(data)


# ------------------------------------------------------------------------------------------------
# Engine API (Unix socket, local engine <-> its sidecar)
# ------------------------------------------------------------------------------------------------

PROTOCOL_VERSION = 1
"""Peer protocol version, checked first at handshake. 1: first version."""

HoldReleaseReason = Literal["notified", "expired", "aborted", "declined", "unregistered"]
PullStateName = Literal["pending", "handshaking", "claiming", "transferring", "done", "failed"]


class RegionSpec(_Strict, kw_only=True, tag="shm"):
    """A DRAM region the engine created as a POSIX shared-memory segment."""

    name: str
    """Segment name (without /dev/shm/)."""
    size_bytes: int
    """Bytes of the segment."""


class CudaRegionSpec(_Strict, kw_only=True, tag="cuda_ipc"):
    """A VRAM region the engine exported as a CUDA IPC handle."""

    handle: bytes
    """The serialised CUDA IPC memory handle (base64 in JSON)."""
    size_bytes: int
    """Bytes of the allocation."""
    device_id: int = 0
    """GPU index the allocation lives on."""


AnyRegionSpec = RegionSpec | CudaRegionSpec


class RegisterRequest(_Strict, kw_only=True):
    """Engine -> sidecar: here is my KV layout and where its memory is."""

    manifest: Manifest
    """The engine's KV manifest (identity fields are filled in by the sidecar)."""
    regions: list[AnyRegionSpec]
    """Memory sources (allocations), each registered with NIXL once. Without ``Region.source``
    one per ``manifest.regions`` entry, same order; with it, any number that regions point into."""


class RegisterResponse(_Strict, kw_only=True):
    """Sidecar -> engine: registration accepted."""

    engine_id: str
    """Identity this sidecar gives the engine rank in tickets and handshakes."""
    epoch: int
    """Boot epoch; changes when the sidecar restarts."""
    peer_address: str
    """host:port of this sidecar's peer API."""
    generation: int = 0
    """Registration generation: 0 for the first registration of this epoch, +1 per
    re-registration after an unregister (vLLM sleep mode, KV-cache re-init)."""


class UnregisterRequest(_Strict, kw_only=True):
    """Engine -> sidecar: forget my memory (sleep, re-init, shutdown) before it goes away.

    In-flight pulls end FAILED once none of their READs can still write; live holds are released
    as ``unregistered``; NIXL registrations are dropped. A later register starts generation + 1.
    """

    generation: int
    """The generation being unregistered (a stale one is a 409)."""


class Identity(_Strict, kw_only=True):
    """Sidecar -> engine: who this sidecar is, so a scheduler process can mint tickets itself."""

    engine_id: str
    """Engine identity used in tickets and handshakes."""
    epoch: int
    """Boot epoch of the sidecar."""
    generation: int
    """Current registration generation (-1 while no engine is registered)."""
    peer_address: str
    """host:port of this sidecar's peer API."""
    tp_rank: int
    """Engine TP rank registered here (-1 while no engine is registered)."""
    tp_size: int
    """Engine TP size registered here (0 while no engine is registered)."""
    default_lease_s: float
    """Lease a hold gets when its request names none."""


class HoldRequest(_Strict, kw_only=True):
    """Engine (prefill) -> sidecar: pin these blocks until a decode side has read them."""

    request_id: str
    """The engine's request id."""
    block_ids: list[list[int]]
    """Logical block ids per group, in request order."""
    num_tokens: Annotated[int, msgspec.Meta(extra_json_schema={"minimum": 0})]
    """Prompt tokens the blocks hold."""
    lease_s: float | None = None
    """Lease length; None uses the sidecar default."""
    hold_id: str = ""
    """Hold id chosen by the engine (a ticket minted ahead by the scheduler names it); empty: the
    sidecar picks one."""


class Ticket(_Strict, kw_only=True):
    """What a decode side needs to pull from one prefill rank; travels in ``kv_transfer_params``.

    Every prefill TP rank's sidecar holds its own copy of the request's blocks and issues its own
    ticket; a pull carries the tickets of all prefill ranks, in rank order.
    """

    engine_id: str
    """Prefill engine identity."""
    epoch: int
    """Prefill sidecar boot epoch at hold time."""
    hold_id: str
    """The hold to claim."""
    request_id: str
    """The prefill engine's request id."""
    block_ids: list[list[int]]
    """Remote logical block ids per group."""
    num_tokens: int
    """Prompt tokens covered."""
    expires_at: float
    """Unix time the hold's lease ends (unless extended by heartbeat)."""
    tp_rank: Annotated[int, msgspec.Meta(extra_json_schema={"minimum": 0})]
    """Prefill TP rank whose sidecar holds the blocks (one ticket per prefill rank)."""
    tp_size: Annotated[int, msgspec.Meta(extra_json_schema={"minimum": 1})]
    """Prefill TP size."""
    peer: str
    """Peer API address (host:port) of that rank's sidecar."""
    generation: int = 0
    """Prefill registration generation at hold time (a re-registered engine has a new one)."""
    token: str = ""
    """HMAC-SHA256 (hex) over the other fields, keyed by the shared peer secret."""


class AbortHoldRequest(_Strict, kw_only=True):
    """Engine -> sidecar: give up a hold (request cancelled)."""

    hold_id: str
    """The hold to abort."""


class PullRequest(_Strict, kw_only=True):
    """Engine (decode) -> sidecar: read a ticket's blocks into local blocks."""

    tickets: Annotated[list[Ticket], msgspec.Meta(extra_json_schema={"minItems": 1})]
    """The tickets of every prefill TP rank, rank order (same request, same block ids)."""
    block_ids: list[list[int]]
    """Local logical block ids per group, aligned with the tickets' block_ids; -1 skips a block."""
    deadline_s: float = 30.0
    """Seconds the whole pull may take (handshake, claim, transfer)."""
    request_id: str = ""
    """The decode engine's request id, echoed in the finished-pulls feed."""
    num_tokens: int = -1
    """Prompt tokens the decode wants moved (-1: the tickets' num_tokens). Fewer than the
    tickets' (Mamba partial prefill) or block sizes that differ between the sides (re-blocking)
    map token ranges instead of block ids."""


class DeclineRequest(_Strict, kw_only=True):
    """Engine (decode) -> sidecar: I will not read these tickets (rejected, aborted); release the
    prefill holds now instead of at lease expiry."""

    tickets: list[Ticket]
    """Tickets of the holds to release: any requests, any prefill ranks (MACs are checked)."""
    reason: str = ""
    """Why, for logs (e.g. ``rejected``, ``aborted``)."""


class KeepaliveRequest(_Strict, kw_only=True):
    """Engine (decode) -> sidecar: keep the holds behind these tickets alive (requests queued).

    The sidecar groups the tickets by prefill sidecar (``Ticket.peer``) and sends each one
    heartbeat for its holds; the answer is a HeartbeatResponse over all of them.
    """

    tickets: list[Ticket]
    """Tickets of the holds to extend: any requests, any prefill ranks (repeats count once)."""
    extend_s: Annotated[float, msgspec.Meta(extra_json_schema=_POSITIVE)]
    """Seconds from now each lease should last at least (each prefill side caps it)."""


class PullAccepted(_Strict, kw_only=True):
    """Sidecar -> engine: the pull is under way."""

    pull_id: str
    """Handle for status queries."""


class PullStatus(_Strict, kw_only=True):
    """State of one pull."""

    pull_id: str
    """The pull."""
    state: PullStateName
    """Forward-only: pending < handshaking < claiming < transferring < done; failed is final."""
    reason: str = ""
    """Machine-readable failure code when failed (e.g. hold_expired, peer_disconnected)."""
    detail: str = ""
    """Human-readable failure detail."""
    kv_bytes: int = 0
    """Attention bytes moved."""
    state_bytes: int = 0
    """Mamba state bytes moved."""
    descriptors: int = 0
    """Descriptors posted."""
    duration_s: float = 0.0
    """Wall time from accept to done/failed."""


class ReleasedHold(_Strict, kw_only=True):
    """A hold that ended; the engine may free its blocks."""

    hold_id: str
    """The hold."""
    request_id: str
    """The engine's request id."""
    block_ids: list[list[int]]
    """The blocks it pinned, per group."""
    reason: HoldReleaseReason
    """Why it ended."""


class ReleasedHolds(_Strict, kw_only=True):
    """Feed of released holds since a cursor (one page)."""

    holds: list[ReleasedHold]
    """Released holds, oldest first."""
    cursor: int
    """Pass back to get only newer entries."""
    more: bool = False
    """More entries are waiting past this page: ask again at once with ``cursor``."""


class FinishedPull(_Strict, kw_only=True):
    """A pull that reached done or failed (the finished-pulls feed)."""

    pull_id: str
    """The pull."""
    request_id: str
    """``PullRequest.request_id`` of the pull."""
    state: Literal["done", "failed"]
    """How it ended."""
    reason: str = ""
    """Failure reason code when failed."""
    failed_block_ids: list[list[int]] = []
    """Local block ids per group whose bytes are not valid (all of the pull's when failed)."""


class FinishedPulls(_Strict, kw_only=True):
    """Feed of finished pulls since a cursor (one page); one local call per engine step."""

    pulls: list[FinishedPull]
    """Finished pulls, oldest first."""
    cursor: int
    """Pass back to get only newer entries."""
    more: bool = False
    """More entries are waiting past this page."""


class StoreSaveRequest(_Strict, kw_only=True):
    """Engine -> sidecar: keep a request's computed blocks in the store (issue 12)."""

    request_id: str
    """The engine's request id, for logs."""
    keys: list[str]
    """Chunk keys of the prompt (``kvxferd.store.chunk_keys``): one per ``store_chunk_tokens``
    tokens, the last chunk possibly partial."""
    block_ids: list[list[int]] = []
    """Logical block ids per group, in request order (mamba: the state block last); empty when
    ``hold_id`` names them."""
    num_tokens: int = -1
    """Tokens the blocks hold (the Mamba state is the state after this many); -1 with
    ``hold_id``: the hold's."""
    hold_id: str = ""
    """Save the blocks of this live hold (pinned while it lasts) instead of ``block_ids``."""


class StoreSaved(_Strict, kw_only=True):
    """Sidecar -> engine: what a save stored; the blocks may be freed once this arrives."""

    chunks_saved: int
    """Entries (chunk x group) written."""
    chunks_present: int
    """Entries already in the store (not written again)."""
    kv_bytes: int = 0
    """Attention bytes copied out of the blocks."""
    state_bytes: int = 0
    """Mamba state bytes copied out of the blocks."""
    dram_bytes: int = 0
    """Entry bytes put into the DRAM tier."""
    file_bytes: int = 0
    """Entry bytes written to the file tier."""
    duration_s: float = 0.0
    """Wall time of the save."""


class StoreLookupRequest(_Strict, kw_only=True):
    """Engine -> sidecar: how much of this prompt can the store serve?"""

    keys: list[str]
    """Chunk keys of the prompt."""
    num_tokens: int
    """Prompt tokens the keys cover."""


class StoreLookup(_Strict, kw_only=True):
    """Sidecar -> engine: tokens each group can serve, and the prefix all of them can."""

    matched_tokens: list[int]
    """Per group: attention, the chunks present from the start; mamba, the end of the latest
    chunk with a saved state."""
    matched: int
    """Tokens a load can bring back: the longest prefix every group serves (a state exactly at
    its end). Less than a group's own count when groups disagree (logged, counted)."""
    disagree: bool = False
    """Whether some group's count differs from ``matched``."""


class StoreLoadRequest(_Strict, kw_only=True):
    """Engine -> sidecar: write a prompt's first tokens from the store into local blocks."""

    keys: list[str]
    """Chunk keys of the tokens to load (one per chunk of ``num_tokens``)."""
    block_ids: list[list[int]]
    """Local logical block ids per group (mamba: the state block last)."""
    num_tokens: int
    """Tokens to load: a lookup's ``matched`` (or fewer, on a chunk boundary)."""
    request_id: str = ""
    """The engine's request id, for logs."""
    deadline_s: float = 30.0
    """Past this the load stops before its next chunk and answers failed (``deadline``); the
    answer comes only once nothing more is written (a client waits a margin longer)."""


class StoreLoadStatus(_Strict, kw_only=True):
    """Sidecar -> engine: a load's end state; like PullStatus, a failed load wrote nothing valid."""

    state: Literal["done", "failed"]
    """done: every byte of ``num_tokens`` tokens is in the blocks; failed: treat them as unset."""
    reason: str = ""
    """Failure code: store_miss (an entry is not there, or went away), store_corrupt (an entry
    failed its checks and was deleted)."""
    detail: str = ""
    """Human-readable failure detail."""
    tokens: int = 0
    """Tokens loaded."""
    kv_bytes: int = 0
    """Attention bytes written into the blocks."""
    state_bytes: int = 0
    """Mamba state bytes written into the blocks."""
    dram_bytes: int = 0
    """Entry bytes served by the DRAM tier."""
    file_bytes: int = 0
    """Entry bytes read from the file tier."""
    dram_hit_rate: float = 0.0
    """Share of the entry bytes served by DRAM (the rest came from files)."""
    duration_s: float = 0.0
    """Wall time of the load."""


# ------------------------------------------------------------------------------------------------
# Peer API (TCP, every request signed with the shared secret, sidecar <-> sidecar)
# ------------------------------------------------------------------------------------------------


class Handshake(msgspec.Struct, frozen=True, kw_only=True):
    """Exchanged both ways on first contact (per engine id + epoch); lenient to new fields."""

    protocol_version: int
    """PROTOCOL_VERSION of the sender."""
    engine_id: str
    """Sender's engine identity."""
    epoch: int
    """Sender's boot epoch."""
    agent_name: str
    """Sender's NIXL agent name."""
    agent_metadata: bytes
    """Sender's NIXL agent metadata (base64 in JSON)."""
    manifest: Manifest
    """Sender's KV manifest."""
    region_bases: list[int]
    """Base address of each manifest region in the sender's process (for READ descriptors)."""


class ClaimRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Decode sidecar -> prefill sidecar: pin a hold while I read it."""

    ticket: Ticket
    """The ticket (its HMAC is checked)."""
    reader: str
    """The reader's agent name (the notification will come from it)."""
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

    hold_ids: list[str]
    """Holds to extend."""
    extend_s: Annotated[float, msgspec.Meta(extra_json_schema=_POSITIVE)]
    """Seconds to extend each lease by (capped by the prefill side)."""


class HeartbeatResponse(msgspec.Struct, frozen=True, kw_only=True):
    """Which holds were extended and which are gone."""

    extended: list[str]
    """Holds whose lease was extended."""
    missing: list[str]
    """Holds that no longer exist (expired or released)."""
    unanswered: list[str] = []
    """Holds whose prefill sidecar gave no usable answer (unreachable, timed out, refused), so
    their lease is unknown; only a decode sidecar's keepalive answer has any."""


class DeclineResponse(msgspec.Struct, frozen=True, kw_only=True):
    """What a decline did to each hold (the engine API merges every prefill side's answer)."""

    released: list[str]
    """Holds released now, reason ``declined``."""
    missing: list[str]
    """Holds that were already gone (released, expired) or do not match their ticket."""
    busy: list[str] = []
    """Holds a reader has claimed and may be reading: left to its notification or expiry."""
    unanswered: list[str] = []
    """Holds whose prefill sidecar gave no usable answer (they expire with their lease)."""


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """Body of every 4xx/5xx answer of both APIs."""

    error: str
    """Error class, e.g. BlockIdError."""
    detail: str
    """Human-readable message."""
    field: str = ""
    """The offending request field, when one is to blame."""
