"""The engine API's messages (Unix socket, an engine and its own sidecar)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvxferd.wire.manifest import (
    _POSITIVE,
    MAX_GROUPS,
    MAX_REGIONS,
    ONE_LINE_PATTERN,
    ChosenHoldId,
    EngineId,
    EngineInstance,
    FedRequestId,
    HoldId,
    Manifest,
    NotAfterNs,
    RegistrationGeneration,
    RequestId,
    _Strict,
)

PROTOCOL_VERSION = 2
"""Peer protocol version, checked first at handshake. 1: first version."""
ENGINE_API_VERSION = 2
"""Engine API version, in ``Identity``: bumped when engine and sidecar must both know a change
(a request field, a meaning); the vLLM connector refuses a sidecar whose version differs.
1: registrations name their generation and instance (sidecars from before report 0).
2: holds, pulls, store saves and loads carry ``not_after_ns`` (a sidecar of 1 refuses the
field; one that ignored it would act on calls the engine gave up)."""

MAX_TOKENS = 1 << 24
"""Most tokens a hold may cover (16,777,216): past every model's context."""
HOLD_SPARE_BLOCKS = 1024
"""Ids a hold's group may list past the blocks its tokens span: vLLM allocates lookahead slots
for speculative decoding (a Mamba group one more state block per draft token) and a partial
prefill leaves out the last token. Past any drafter's proposals."""
MAX_BLOCK_IDS = MAX_TOKENS + HOLD_SPARE_BLOCKS
"""Most ids one group's list carries (a hold's, a ticket's, a pull's, a store call's): the blocks
MAX_TOKENS tokens span at the smallest block size (one token), plus HOLD_SPARE_BLOCKS. Refused
at decode (msgpack and msgspec.convert count before converting any id); the sidecar then bounds
each list by the call's own tokens and block sizes."""
MAX_TP = 1024
"""Largest TP size on either side: tickets a pull carries (one per prefill rank), a ticket's
rank and size, the reader TP size a claim announces."""
MAX_TICKETS_PER_CALL = 4096
"""Most tickets one decline or keepalive carries, and hold ids one heartbeat names: a step's
declines of 256 requests from TP-16 prefills. A caller with more sends several calls."""
MAX_PAGE_ENTRIES = 4096
"""Most entries one page of a feed (released holds, finished pulls) carries: the largest
``limit`` a feed call may ask for."""
DECLINE_REASON_MAX_LENGTH = 256
"""Most characters of a decline's reason (for the prefill sides' logs)."""
_HOST = r"[A-Za-z0-9._:%\[\]-]{1,255}"
PEER_HOST_PATTERN = rf"^{_HOST}(?!\n)$"
"""A sidecar's advertised host: a DNS name, IPv4, or IPv6 (bare or in brackets, with a zone)."""
PEER_ADDRESS_PATTERN = rf"^{_HOST}:[0-9]{{1,5}}(?!\n)$"
"""A sidecar's peer address, ``host:port`` with a PEER_HOST_PATTERN host (at most 261
characters): the decode side connects to it and sends it as the HTTP ``Host``."""
PeerAddress = Annotated[str, msgspec.Meta(max_length=261, pattern=PEER_ADDRESS_PATTERN)]
GroupBlockIds = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
"""One group's block ids (at most MAX_BLOCK_IDS)."""
BlockIdsPerGroup = Annotated[list[GroupBlockIds], msgspec.Meta(max_length=MAX_GROUPS)]
"""A call's block ids, one list per group (at most MAX_GROUPS lists of MAX_BLOCK_IDS ids)."""
_FED_PER_GROUP = msgspec.Meta(extra_json_schema={"maxItems": MAX_GROUPS})
"""MAX_GROUPS in the schema only, on what a sidecar feeds its own engine (as FedRequestId)."""

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
    regions: Annotated[list[AnyRegionSpec], msgspec.Meta(max_length=MAX_REGIONS)]
    """Memory sources (allocations), each registered with NIXL once. Without ``Region.source``
    one per ``manifest.regions`` entry, same order; with it, any number that regions point into
    (at most MAX_REGIONS)."""
    instance: EngineInstance = ""
    """The registering engine process's own id; ``Identity.instance`` shows it, so an engine
    whose registration another engine replaced can tell (empty: none given)."""


class RegisterResponse(_Strict, kw_only=True):
    """Sidecar -> engine: registration accepted."""

    engine_id: EngineId
    """Identity this sidecar gives the engine rank in tickets and handshakes."""
    epoch: int
    """Boot epoch; changes when the sidecar restarts."""
    peer_address: str
    """host:port of this sidecar's peer API."""
    generation: int = 0
    """Registration generation: a random number below 2**48 for the first registration of
    this epoch (so none repeats one of an earlier sidecar process), +1 per re-registration
    after an unregister (vLLM sleep mode, KV-cache re-init)."""


class UnregisterRequest(_Strict, kw_only=True):
    """Engine -> sidecar: forget my memory (sleep, re-init, shutdown) before it goes away.

    In-flight pulls end FAILED once none of their READs can still write; live holds are released
    as ``unregistered``; NIXL registrations are dropped. A later register starts generation + 1.
    """

    generation: int
    """The generation being unregistered (a stale one is a 409)."""


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """Sidecar -> engine: who this sidecar is, so a scheduler process can mint tickets itself.

    Unlike requests, unknown fields are ignored: an engine's connector still reads a newer
    sidecar's identity, and so its ``engine_api_version``, to say why the two cannot work
    together.
    """

    engine_id: EngineId
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
    max_claim_s: float = 120.0
    """Longest a claim pins a hold here: how long an unregister may have to wait for a
    decode that claimed one to finish its READ."""
    instance: EngineInstance = ""
    """``RegisterRequest.instance`` of the engine registered now (empty while none is, or it
    gave none)."""
    engine_api_version: int = 0
    """ENGINE_API_VERSION of the sidecar (0: a sidecar from before this field); an engine whose
    own differs refuses to start."""
    kvxferd_version: str = ""
    """The sidecar's kvxferd release, for that refusal's message."""
    pod_ranks: int = 1
    """Engine TP ranks this sidecar serves together (``serve --pod-ranks``): >1 is a pod
    sidecar, whose one ticket per request spans ranks 0..pod_ranks-1."""


class HoldRequest(_Strict, kw_only=True):
    """Engine (prefill) -> sidecar: pin these blocks until a decode side has read them."""

    request_id: RequestId
    """The engine's request id (at most 512 characters on one line, ONE_LINE_PATTERN)."""
    block_ids: BlockIdsPerGroup
    """Logical block ids per group, in request order (at most MAX_GROUPS lists of
    MAX_BLOCK_IDS)."""
    num_tokens: Annotated[
        int, msgspec.Meta(extra_json_schema={"minimum": 0, "maximum": MAX_TOKENS})
    ]
    """Prompt tokens the blocks hold (at most MAX_TOKENS). A group lists at most the blocks
    they span (at least 1) plus HOLD_SPARE_BLOCKS (lookahead), else a 422 naming it."""
    lease_s: float | None = None
    """Lease length; None uses the sidecar default."""
    hold_id: ChosenHoldId = ""
    """Hold id chosen by the engine (a ticket minted ahead by the scheduler names it): 1-128 of
    A-Z a-z 0-9 . _ : -; empty: the sidecar picks one."""
    generation: RegistrationGeneration = None
    """The registration generation these block ids refer to; another one is a 409
    (StaleGenerationError) and nothing is held. None: not checked."""
    tp_rank: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_TP)] = -1
    """The placing rank, on a pod sidecar (required there: the hold is claimable once every
    rank placed it with the same ``hold_id``, blocks and tokens); -1: the sidecar's one rank (on
    a one-rank sidecar, -1 or that rank; another is a 422 naming it)."""
    not_after_ns: NotAfterNs = 0
    """The engine's monotonic clock (ns) past which it no longer waits for this answer: a hold
    arriving later is not placed (a 408, CallExpiredError), since the engine may have freed
    the blocks; 0: no bound. The Python client sets it to its call timeout."""


class Ticket(_Strict, kw_only=True):
    """What a decode side needs to pull from one prefill rank; travels in ``kv_transfer_params``.

    Every prefill TP rank's sidecar holds its own copy of the request's blocks and issues its own
    ticket; a pull carries the tickets of all prefill ranks, in rank order. A pod sidecar
    (``ranks`` > 1) serves every rank of its engine: its one ticket is the pull's only one.
    """

    engine_id: EngineId
    """Prefill engine identity (1-128 printable ASCII characters, no space)."""
    epoch: int
    """Prefill sidecar boot epoch at hold time."""
    hold_id: HoldId
    """The hold to claim."""
    request_id: RequestId
    """The prefill engine's request id (at most 512 characters on one line, ONE_LINE_PATTERN)."""
    block_ids: BlockIdsPerGroup
    """Remote logical block ids per group (at most MAX_GROUPS lists of MAX_BLOCK_IDS)."""
    num_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
    """Prompt tokens covered (0..MAX_TOKENS, as a hold's)."""
    expires_at: float
    """Unix time the hold's lease ends (unless extended by heartbeat)."""
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP)]
    """Prefill TP rank whose sidecar holds the blocks (one ticket per prefill rank)."""
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
    """Prefill TP size (1..MAX_TP)."""
    peer: PeerAddress
    """Peer API address (host:port, at most 261 characters) of that rank's sidecar."""
    generation: int = 0
    """Prefill registration generation at hold time (a re-registered engine has a new one)."""
    ranks: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)] = 1
    """Prefill TP ranks the hold spans, ``tp_rank`` 0 up (1: one rank's sidecar; ``tp_size``: a
    pod sidecar's hold over every rank, the pull's only ticket). MAC-covered."""
    token: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*(?!\n)$")] = ""
    """HMAC-SHA256 (64 lowercase hex digits) over the other fields, keyed by the shared peer
    secret."""


class AbortHoldRequest(_Strict, kw_only=True):
    """Engine -> sidecar: give up a hold (request cancelled)."""

    hold_id: HoldId
    """The hold to abort."""


class PullRequest(_Strict, kw_only=True):
    """Engine (decode) -> sidecar: read a ticket's blocks into local blocks."""

    tickets: Annotated[
        list[Ticket], msgspec.Meta(max_length=MAX_TP, extra_json_schema={"minItems": 1})
    ]
    """The tickets of every prefill TP rank, rank order (same request, same block ids; at most
    MAX_TP)."""
    block_ids: BlockIdsPerGroup
    """Local logical block ids per group, aligned with the tickets' block_ids; -1 skips a block
    (at most MAX_GROUPS lists of MAX_BLOCK_IDS).
    With ``num_tokens`` given, a group lists at most the blocks those tokens span (at least 1)
    or as many ids as the ticket's list for it."""
    deadline_s: float = 30.0
    """Seconds the whole pull may take (handshake, claim, transfer; the engine chooses); at most
    the sidecar's ``max_pull_deadline_s`` (600 by default), else a 422 naming it."""
    request_id: RequestId = ""
    """The decode engine's request id, echoed in the finished-pulls feed (at most 512
    characters on one line, ONE_LINE_PATTERN)."""
    num_tokens: int = -1
    """Prompt tokens the decode wants moved (-1: the tickets' num_tokens). Fewer than the
    tickets' (Mamba partial prefill) or block sizes that differ between the sides (re-blocking)
    map token ranges instead of block ids."""
    generation: RegistrationGeneration = None
    """The registration generation these block ids refer to; another one is a 409
    (StaleGenerationError) and nothing is read. None: not checked."""
    not_after_ns: NotAfterNs = 0
    """The engine's monotonic clock (ns) by which the pull must have ended: one arriving later
    is a 408 (CallExpiredError) and reads nothing, and ``deadline_s`` ends there at the latest
    (it counts from the engine's call, not from a late arrival). 0: no bound but
    ``deadline_s``. The Python client sets it to the call's start plus ``deadline_s``."""


class DeclineRequest(_Strict, kw_only=True):
    """Engine (decode) -> sidecar: I will not read these tickets (rejected, aborted); release the
    prefill holds now instead of at lease expiry."""

    tickets: Annotated[list[Ticket], msgspec.Meta(max_length=MAX_TICKETS_PER_CALL)]
    """Tickets of the holds to release: any requests, any prefill ranks (MACs are checked); at
    most MAX_TICKETS_PER_CALL."""
    reason: Annotated[
        str, msgspec.Meta(max_length=DECLINE_REASON_MAX_LENGTH, pattern=ONE_LINE_PATTERN)
    ] = ""
    """Why, for logs (e.g. ``rejected``, ``aborted``; at most 256 characters on one line,
    ONE_LINE_PATTERN: each prefill side logs it)."""


class KeepaliveRequest(_Strict, kw_only=True):
    """Engine (decode) -> sidecar: keep the holds behind these tickets alive (requests queued).

    The sidecar groups the tickets by prefill sidecar (``Ticket.peer``) and sends each one
    heartbeat for its holds; the answer is a HeartbeatResponse over all of them.
    """

    tickets: Annotated[list[Ticket], msgspec.Meta(max_length=MAX_TICKETS_PER_CALL)]
    """Tickets of the holds to extend: any requests, any prefill ranks (repeats count once); at
    most MAX_TICKETS_PER_CALL."""
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
    request_id: FedRequestId
    """The engine's request id."""
    block_ids: Annotated[list[list[int]], _FED_PER_GROUP]
    """The blocks it pinned, per group."""
    reason: HoldReleaseReason
    """Why it ended."""


class ReleasedHolds(_Strict, kw_only=True):
    """Feed of released holds since a cursor (one page)."""

    holds: Annotated[
        list[ReleasedHold], msgspec.Meta(extra_json_schema={"maxItems": MAX_PAGE_ENTRIES})
    ]
    """Released holds, oldest first."""
    cursor: int
    """Pass back to get only newer entries."""
    more: bool = False
    """More entries are waiting past this page: ask again at once with ``cursor``."""


class FinishedPull(_Strict, kw_only=True):
    """A pull that reached done or failed (the finished-pulls feed)."""

    pull_id: str
    """The pull."""
    request_id: FedRequestId
    """``PullRequest.request_id`` of the pull."""
    state: Literal["done", "failed"]
    """How it ended."""
    reason: str = ""
    """Failure reason code when failed."""
    failed_block_ids: Annotated[list[list[int]], _FED_PER_GROUP] = []
    """Local block ids per group whose bytes are not valid (all of the pull's when failed)."""


class FinishedPulls(_Strict, kw_only=True):
    """Feed of finished pulls since a cursor (one page); one local call per engine step."""

    pulls: Annotated[
        list[FinishedPull], msgspec.Meta(extra_json_schema={"maxItems": MAX_PAGE_ENTRIES})
    ]
    """Finished pulls, oldest first."""
    cursor: int
    """Pass back to get only newer entries."""
    more: bool = False
    """More entries are waiting past this page."""
