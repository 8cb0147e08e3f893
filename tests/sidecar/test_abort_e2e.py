"""An engine's abort never frees blocks a decode is reading: a claimed hold stays out of the
released feed until its reader notified, and nobody else may claim it meanwhile.

A real prefill ``kvxferd serve`` over NIXL/UCX on loopback, POSIX shm pools. The reader is this
test's own NIXL agent speaking the peer protocol step by step (handshake, claim, READ,
notification), so the abort lands at a known point: after the claim, before the READ. A real
decode sidecar then tries to pull the aborted hold.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest

from kvxferd.errors import MemoryInUseError
from kvxferd.pattern import verify_pattern
from kvxferd.transport import Agent, TransferState
from kvxferd.wire import PROTOCOL_VERSION, ClaimRequest, ClaimResponse, Handshake, Ticket
from tests.sidecar.harness import (
    EnginePool,
    Sidecar,
    changed_outside,
    peer_signature,
    wait_no_handles,
)
from tests.sidecar.ranks import DIDS, PIDS, Engine, engine_pair

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with engine_pair(str(tmp_path_factory.mktemp("abort"))) as ranks:
        yield ranks


def _peer_post(prefill: Sidecar, path: str, body: object) -> httpx.Response:
    raw = msgspec.json.encode(body)
    headers = {"Authorization": peer_signature(prefill, "POST", path, raw),
               "Content-Type": "application/json"}  # fmt: skip
    return httpx.post(f"http://{prefill.peer}{path}", content=raw, headers=headers, timeout=30)


class Reader:
    """A decode reader driven by hand: its own agent over its own pool (the prefill's layout)."""

    def __init__(self) -> None:
        self.pool = EnginePool(Engine.plan())
        self.agent = Agent(f"reader-{uuid.uuid4().hex[:8]}", progress_thread=False)
        self.bases = [r.base_addr for r in self.agent.register(self.pool.segments)]

    def handshake(self, peer: Sidecar) -> Handshake:
        mine = Handshake(
            protocol_version=PROTOCOL_VERSION, engine_id=f"e{uuid.uuid4().hex[:8]}", epoch=1,
            agent_name=self.agent.name, agent_metadata=self.agent.get_agent_metadata(),
            manifest=self.pool.manifest, region_bases=self.bases,
            tcp_tx_seg_bytes=self.agent.tcp_segments[0],
            tcp_rx_seg_bytes=self.agent.tcp_segments[1],
        )  # fmt: skip
        resp = _peer_post(peer, "/v1/handshake", mine)
        assert resp.status_code == 200, resp.text
        theirs = msgspec.json.decode(resp.content, type=Handshake)
        assert self.agent.add_remote(theirs.agent_metadata) == theirs.agent_name
        return theirs

    def claim(self, peer: Sidecar, ticket: Ticket, claim_s: float) -> None:
        """Claim ``ticket``'s hold for this reader over the signed peer API (200 expected)."""
        claim = ClaimRequest(ticket=ticket, reader=self.agent.name, reader_tp_size=1,
                             claim_s=claim_s)  # fmt: skip
        resp = _peer_post(peer, "/v1/claims", claim)
        assert resp.status_code == 200, resp.text
        assert msgspec.json.decode(resp.content, type=ClaimResponse).hold_id == ticket.hold_id

    def read(self, theirs: Handshake, block_ids: list[int]) -> None:
        """READ whole pages of ``block_ids`` into the same blocks here; bounded wait for DONE."""
        local, remote = [], []
        for r, region in enumerate(self.pool.manifest.regions):
            for b in block_ids:
                off = b * region.page_bytes
                local.append((self.bases[r] + off, region.page_bytes))
                remote.append((theirs.region_bases[r] + off, region.page_bytes))
        xfer = self.agent.read(theirs.agent_name, np.array(local, np.uint64),
                               np.array(remote, np.uint64))  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while xfer.poll() is TransferState.POSTED and time.monotonic() < deadline:
                time.sleep(0.001)
            assert xfer.state is TransferState.DONE, xfer.error
        finally:
            xfer.release()

    def close(self) -> None:
        self.agent.close()
        self.pool.close()


def _pages(views: list[np.ndarray], manifest, block_ids: list[int]) -> list[bytes]:  # noqa: ANN001
    return [bytes(v[b * r.page_bytes : (b + 1) * r.page_bytes])
            for v, r in zip(views, manifest.regions, strict=True) for b in block_ids]  # fmt: skip


@contextlib.contextmanager
def _claimed(
    p: Engine, request_id: str, seed: int, claim_s: float
) -> Iterator[tuple[Ticket, Reader, Handshake]]:
    """A hold of PIDS (filled with ``seed``'s pattern) that a Reader has handshaken for and
    claimed for ``claim_s``: (its ticket, the reader, the prefill's handshake); the reader is
    closed on the way out. The feed is read up to the hold first."""
    p.feed.poll()
    ticket = p.hold(request_id, seed=seed)
    reader = Reader()
    try:
        theirs = reader.handshake(p.sidecar)
        reader.claim(p.sidecar, ticket, claim_s)
        yield ticket, reader, theirs
    finally:
        reader.close()


def test_an_abort_while_a_reader_reads_releases_the_hold_only_after_its_notification(pair):
    p, d = pair
    with _claimed(p, "abort-mid-read", 41, 60.0) as (ticket, reader, theirs):
        p.abort(ticket)  # 204 while the reader is between its claim and its READ
        assert p.feed.poll() == []  # not released: the engine must not free the blocks yet

        # A decode that comes now cannot claim it: its pull fails, never reads "successfully".
        before = d.pool.snapshot()
        status = d.pull([ticket])
        assert (status.state, status.reason) == ("failed", "unknown_hold"), status
        assert "aborted" in status.detail and status.kv_bytes == 0
        assert changed_outside(before, d.pool.views, d.manifest, DIDS) == 0
        assert p.feed.poll() == []

        (blocks,) = PIDS
        reader.read(theirs, blocks)  # the claimed reader's READ: the hold's own bytes
        assert _pages(reader.pool.views, p.manifest, blocks) == _pages(
            p.pool.views, p.manifest, blocks)  # fmt: skip
        assert verify_pattern(p.manifest, reader.pool.views, PIDS, seed=41) is None
        assert p.feed.poll() == []

        reader.agent.send_notif(theirs.agent_name, ticket.hold_id.encode())
        p.released_once(ticket, "aborted")
    wait_no_handles(p.sidecar, d.sidecar)


def test_an_abort_of_an_unclaimed_hold_releases_it_at_once(pair):
    p, d = pair
    p.feed.poll()
    ticket = p.hold("abort-unclaimed", seed=42)
    p.abort(ticket)
    assert p.feed.poll() == [(ticket.hold_id, "aborted")]  # in the feed as the abort answered
    status = d.pull([ticket])
    assert (status.state, status.reason) == ("failed", "unknown_hold"), status


# An unregister gives every hold up the same way: the engine's memory must not go (nor its blocks
# be freed) while a decode that claimed a hold may still READ it. These run last: each ends by
# registering the prefill again.


def _unregister(p: Engine) -> None:
    with p.sidecar.client(timeout_s=60) as c:
        c.unregister(c.identity().generation)


@contextlib.contextmanager
def _registered(p: Engine) -> Iterator[None]:
    """Register the prefill again on the way out (the test unregisters it)."""
    try:
        yield
    finally:
        p.register()
        p.feed.cursor = 0  # a new registration's feed counts from its start


def test_an_unregister_while_a_reader_may_read_keeps_the_memory_until_its_notification(pair):
    p, d = pair
    with _claimed(p, "unregister-mid-read", 44, 60.0) as (ticket, reader, theirs), _registered(p):
        with pytest.raises(MemoryInUseError, match="may still be read by decodes"):
            _unregister(p)  # waits a few seconds for the reader, then refuses: retry
        assert p.feed.poll() == []  # still registered, and the hold's blocks still pinned

        status = d.pull([ticket])  # nobody else may claim it now
        assert (status.state, status.reason) == ("failed", "unknown_hold"), status
        assert "unregistered" in status.detail

        (blocks,) = PIDS
        reader.read(theirs, blocks)
        assert verify_pattern(p.manifest, reader.pool.views, PIDS, seed=44) is None
        assert p.feed.poll() == []
        reader.agent.send_notif(theirs.agent_name, ticket.hold_id.encode())
        p.released_once(ticket, "unregistered")
        _unregister(p)
    wait_no_handles(p.sidecar, d.sidecar)


def test_an_unregister_waits_for_a_claim_to_end_and_then_lets_the_memory_go(pair):
    p, d = pair
    with _claimed(p, "unregister-claim-ends", 45, 0.5), _registered(p):
        # The reader never notifies; its claim (so any READ of it) ends well inside the wait.
        _unregister(p)
        with p.sidecar.client() as c:
            assert c.identity().generation == -1
    p.feed.poll()
    wait_no_handles(p.sidecar, d.sidecar)
