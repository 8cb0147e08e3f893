"""The engine-facing API (Unix socket, local only): register, hold, abort, pull, keepalive,
released feed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from fastapi import FastAPI

from kvxferd.api.codec import StructResponse
from kvxferd.api.openapi import HEALTH, document, install_openapi
from kvxferd.api.operations import Gate, Operation, Query, mount
from kvxferd.wire import (
    MAX_PAGE_ENTRIES,
    AbortHoldRequest,
    DeclineRequest,
    DeclineResponse,
    FinishedPulls,
    HeartbeatResponse,
    HoldRequest,
    Identity,
    KeepaliveRequest,
    PullAccepted,
    PullRequest,
    PullStatus,
    RegisterRequest,
    RegisterResponse,
    ReleasedHolds,
    StoreLoadRequest,
    StoreLoadStatus,
    StoreLookup,
    StoreLookupRequest,
    StoreSaved,
    StoreSaveRequest,
    Ticket,
    UnregisterRequest,
)

if TYPE_CHECKING:
    from kvxferd.sidecar.service import Sidecar

TITLE = "kvxferd engine API"
DESCRIPTION = (
    "What an engine rank asks of its own sidecar, over a Unix socket (0600, local only, no "
    "token): register the KV pool once, hold prefilled blocks for a decode side (a Ticket), "
    "pull a ticket's blocks into local blocks, keep the holds of queued requests alive, and "
    "follow the feed of released holds to free blocks. Every 4xx/5xx body is an ErrorBody. "
    "Every operation also takes its body as MessagePack (`Content-Type: application/msgpack`, "
    "the same schema) and answers in MessagePack, errors included, when the request says "
    "`Accept: application/msgpack`; refusals at the edge (408, 413, 431) are always JSON."
)
MAX_WAIT_S = 60.0
"""Upper bound of a pull-status long poll; a larger ``wait`` is cut to it."""


async def register(sidecar: Sidecar, req: RegisterRequest) -> RegisterResponse:
    """Register the engine's manifest and memory regions (once per sidecar epoch).

    Each region is mapped and registered with NIXL once. A second registration answers 409;
    restart the sidecar to change the layout.
    """
    return await sidecar.register(req)


async def unregister(sidecar: Sidecar, req: UnregisterRequest) -> None:
    """Forget the engine's memory (sleep mode, KV-cache re-init, an engine restart).

    In-flight pulls end FAILED once none of their READs can still write, live holds are released
    ``unregistered`` (a claimed one once its readers notified or their claims ended: it waits
    a few seconds for that, else a 503 MemoryInUseError), NIXL registrations are dropped and the
    sources unmapped. A stale
    ``generation`` is a 409. While a READ that could not be confirmed stopped (quarantined) may
    still write the memory, pulls and holds end all the same but the memory stays registered and
    mapped: a 503 MemoryInUseError says how many READs; retry once they ended. Store loads stop
    before their next entry and the answer waits for them and store saves to end (a 503
    MemoryInUseError if they still run after a few seconds). Registering again starts
    generation + 1.
    """
    await sidecar.unregister(req)


async def identity(sidecar: Sidecar) -> Identity:
    """Who this sidecar is (engine id, epoch, generation, peer address, TP rank, default lease),
    so a scheduler process can mint tickets itself; generation -1 while nothing is registered."""
    return sidecar.identity()


async def hold(sidecar: Sidecar, req: HoldRequest) -> Ticket:
    """Pin a prefilled request's blocks under a lease; returns the Ticket a decode side pulls with.

    The blocks stay pinned until the reader's NIXL notification, the end of the lease, or an
    abort; each hold shows up exactly once in the released feed. The same hold placed again
    (hold id, request, blocks, tokens) is answered its ticket again; another hold of a request
    with a live hold is a 409 that gives the live one up (the engine frees a refused request's
    blocks).
    """
    return sidecar.hold(req)


async def abort(sidecar: Sidecar, req: AbortHoldRequest) -> None:
    """Give up a hold (request cancelled); its blocks show up in the released feed.

    No new reader may claim it from now on. One a decode has claimed and may be reading stays
    pinned until its readers notify or their claims end: the release (and so the engine's
    free of the blocks) may come after this answer, through the released feed.
    """
    sidecar.abort(req)


async def pull(sidecar: Sidecar, req: PullRequest) -> PullAccepted:
    """Start reading a request's blocks from its prefill ranks into local blocks.

    The request is checked before it is accepted (4xx naming the field); the transfer runs in
    the background: poll its status with the returned pull id.
    """
    return await sidecar.start_pull(req)


async def pull_status(sidecar: Sidecar, pull_id: str, wait: float) -> PullStatus:
    """A pull's state; ``wait`` long-polls until it is done or failed (cut to MAX_WAIT_S)."""
    return await sidecar.pull_status(pull_id, min(wait, MAX_WAIT_S))


async def run_pull(sidecar: Sidecar, req: PullRequest) -> PullStatus:
    """Run a pull and answer its final status: one engine call per pull.

    Checked like ``POST /v1/pulls`` (4xx naming the field); the answer comes when the pull is
    done or failed, bounded by its deadline plus the time its READs need to settle (a FAILED
    answer means none of its READs can still write).
    """
    return await sidecar.run_pull(req)


async def finished_pulls(sidecar: Sidecar, cursor: int, limit: int) -> FinishedPulls:
    """Pulls finished since ``cursor``, oldest first: one non-blocking call per engine step.

    Each entry is done, or failed with the local block ids whose bytes are invalid. Paged:
    ``more`` says another page is waiting at the returned cursor.
    """
    return sidecar.finished_pulls(cursor, limit)


async def keepalive(sidecar: Sidecar, req: KeepaliveRequest) -> HeartbeatResponse:
    """Keep the prefill holds of requests still queued here alive (a heartbeat per prefill side).

    Every ticket's MAC is checked (401 naming the ticket). The tickets are grouped by prefill
    sidecar, each gets one heartbeat (bounded by the handshake timeout), and the answers are
    merged: ``extended``, ``missing`` (gone: expired or released, pull will fail), and
    ``unanswered`` (that prefill sidecar gave no usable answer; retry).
    """
    return await sidecar.keepalive(req)


async def decline(sidecar: Sidecar, req: DeclineRequest) -> DeclineResponse:
    """Release the prefill holds of requests this engine will not read (rejected, aborted).

    Every ticket's MAC is checked here before any network call (401 naming
    ``tickets[i].token``). The tickets are grouped by prefill sidecar and each gets one signed
    decline; the answers are merged: ``released`` (now), ``missing`` (already gone),
    ``busy`` (a reader claimed it) and ``unanswered`` (that prefill side gave no usable answer;
    the hold expires with its lease).
    """
    return await sidecar.decline(req)


async def released(sidecar: Sidecar, cursor: int, limit: int) -> ReleasedHolds:
    """One page of holds released since ``cursor`` (notified, expired, aborted, declined,
    unregistered): free their blocks. ``more`` says another page is waiting."""
    return sidecar.released_since(cursor, limit)


async def store_save(sidecar: Sidecar, req: StoreSaveRequest) -> StoreSaved:
    """Copy a request's computed blocks (``block_ids``, or a live hold's with ``hold_id``) into
    the store (DRAM pool, then files) in the canonical format; entries already stored are
    skipped. Free the blocks (release the hold) only once this answers."""
    return await sidecar.offload.save(req)


async def store_lookup(sidecar: Sidecar, req: StoreLookupRequest) -> StoreLookup:
    """Tokens of a prompt the store can serve, per group and for all groups (the minimum)."""
    return await sidecar.offload.lookup(req)


async def store_load(sidecar: Sidecar, req: StoreLoadRequest) -> StoreLoadStatus:
    """Write a prompt's first tokens from the store into local blocks; answered when done or
    failed (store_miss, store_corrupt: the blocks hold nothing valid then)."""
    return await sidecar.offload.load(req)


async def healthz(sidecar: Sidecar) -> dict[str, Any]:
    """Liveness: the process answers."""
    return {"status": "ok"}


WAIT = Query(
    "wait",
    Annotated[float, msgspec.Meta(ge=0)],
    0.0,
    f"Seconds to wait for the pull to finish; larger values are cut to {MAX_WAIT_S:g}.",
)
CURSOR = Query(
    "cursor",
    Annotated[int, msgspec.Meta(ge=0)],
    0,
    "The cursor of the previous answer; 0 reads the feed from its start.",
)
LIMIT = Query(
    "limit",
    Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE_ENTRIES)],
    1024,
    "Most entries in one page (a page is also cut at 1 MiB).",
)

OPERATIONS = [
    Operation("POST", "/v1/register", register, RegisterRequest, RegisterResponse,
              errors=(400, 409, 422, 500, 502)),
    Operation("POST", "/v1/unregister", unregister, UnregisterRequest, None, status=204,
              errors=(400, 409, 422, 500, 503), needs_engine=True),
    Operation("GET", "/v1/identity", identity, None, Identity, errors=(500,)),
    Operation("POST", "/v1/holds", hold, HoldRequest, Ticket,
              errors=(400, 409, 422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/holds/abort", abort, AbortHoldRequest, None, status=204,
              errors=(400, 404, 410, 422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/pulls", pull, PullRequest, PullAccepted, status=202,
              errors=(400, 401, 422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/pulls/run", run_pull, PullRequest, PullStatus,
              errors=(400, 401, 422, 500, 503), needs_engine=True),
    Operation("GET", "/v1/pulls/finished", finished_pulls, None, FinishedPulls,
              query=(CURSOR, LIMIT), errors=(422, 500, 503), needs_engine=True),
    Operation("GET", "/v1/pulls/{pull_id}", pull_status, None, PullStatus, query=(WAIT,),
              errors=(404, 422, 500)),
    Operation("POST", "/v1/keepalive", keepalive, KeepaliveRequest, HeartbeatResponse,
              errors=(400, 401, 422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/decline", decline, DeclineRequest, DeclineResponse,
              errors=(400, 401, 422, 500, 503), needs_engine=True),
    Operation("GET", "/v1/released", released, None, ReleasedHolds, query=(CURSOR, LIMIT),
              errors=(422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/store/save", store_save, StoreSaveRequest, StoreSaved,
              errors=(400, 404, 410, 422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/store/lookup", store_lookup, StoreLookupRequest, StoreLookup,
              errors=(400, 422, 500, 503), needs_engine=True),
    Operation("POST", "/v1/store/load", store_load, StoreLoadRequest, StoreLoadStatus,
              errors=(400, 422, 500, 503), needs_engine=True),
    Operation("GET", "/healthz", healthz, None, HEALTH),
]  # fmt: skip
"""The route table: served by engine_app, documented by engine_document."""


def engine_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the engine API."""
    return document(TITLE, DESCRIPTION, OPERATIONS)


def engine_app(sidecar: Sidecar) -> FastAPI:
    """The FastAPI app an engine rank talks to (its OpenAPI document at /openapi.json)."""
    app = FastAPI(title=TITLE, version="1", default_response_class=StructResponse)
    mount(app, OPERATIONS, sidecar, Gate(ready=lambda: sidecar.ready, msgpack=True))
    install_openapi(app, engine_document)
    return app
