"""StripedAgent: a large READ goes as equal byte ranges, one per agent, posted at once, and
lands byte-exactly; it reports FAILED only once no part can still write; READs that carry a
notification go whole on the main agent, small ones whole on a stripe that never notifies, so
they complete even while a peer we notified does not progress."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxferd.errors import TransportLookupError
from kvxferd.memory import SharedMemoryRegion
from kvxferd.transport import Agent, LiveHandles, TransferState, stripes
from kvxferd.transport.stripes import StripedAgent, StripedRead, cut, piece
from tests.transport.conftest import SENTINEL, assert_landed, read_tables, unique

WAIT_S = 20.0
PAUSE_S = 8.0
ZERO = LiveHandles(0, 0, 0, 0)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_the_ranges_cover_every_byte_once_in_order_and_split_a_row_where_a_cut_falls(k):
    rng = np.random.default_rng(k)
    lens = rng.integers(1, 5000, 17).astype(np.uint64)
    addrs = np.cumsum(lens) * 3  # gaps between rows: a wrong offset would show
    table = np.stack([addrs, lens, np.zeros_like(lens)], axis=1)
    every = np.concatenate([np.arange(a, a + n) for a, n in table[:, :2].astype(np.int64)])
    pieces = [piece(table, where) for where in cut(table, k)]
    covered = np.concatenate([np.arange(a, a + n) for p in pieces
                              for a, n in p[:, :2].astype(np.int64)])  # fmt: skip
    assert np.array_equal(covered, every)
    sizes = [int(p[:, 1].sum()) for p in pieces]
    assert max(sizes) - min(sizes) <= 1  # equal shares


def test_one_huge_row_is_split_too():
    table = np.array([[1 << 20, 1000, 0]], np.uint64)
    assert [p.tolist() for p in (piece(table, w) for w in cut(table, 3))] == [
        [[1 << 20, 333, 0]], [[(1 << 20) + 333, 333, 0]], [[(1 << 20) + 666, 334, 0]]
    ]  # fmt: skip


@pytest.fixture
def striped(dst: SharedMemoryRegion, monkeypatch) -> Iterator[StripedAgent]:
    monkeypatch.setattr(stripes, "MIN_BYTES", 1 << 20)  # the peer serves 4 MiB
    a = StripedAgent(unique("striped"), stripes=3)
    a.register(dst)
    yield a
    a.close()
    assert a.live_handles() == ZERO


@pytest.mark.nixl
def test_a_large_read_goes_in_stripes_and_lands_byte_exact(peer, dst, striped):
    striped.add_remote(peer.metadata)
    ranges = [(0, 4096, 1 << 20), (2 << 20, (1 << 20) + 8192, 1_500_001), (12345, 3 << 20, 999)]
    local, remote = read_tables(peer, dst, ranges)
    xfer = striped.read(peer.name, local, remote)
    try:
        assert isinstance(xfer, StripedRead)
        deadline_polls = 0
        while xfer.poll() is TransferState.POSTED and deadline_polls < 10_000_000:
            deadline_polls += 1
        assert xfer.state is TransferState.DONE and xfer.error is None
        telemetry = xfer.telemetry()
        assert telemetry is not None and telemetry["stripes"] == 3
        assert telemetry["bytes"] == sum(n for *_, n in ranges)
    finally:
        xfer.release()
    assert_landed(peer, dst, ranges)
    assert striped.live_handles().transfers == 0


@pytest.mark.nixl
def test_a_small_read_or_one_with_a_notification_goes_whole(peer, dst, striped):
    striped.add_remote(peer.metadata)
    for ranges, notif in (([(0, 0, 4096)], b""), ([(0, 0, 2 << 20)], b"hold-1")):
        local, remote = read_tables(peer, dst, ranges)
        with striped.read(peer.name, local, remote, notif) as xfer:
            assert not isinstance(xfer, StripedRead)
            assert xfer.wait(WAIT_S) is TransferState.DONE
        assert_landed(peer, dst, ranges)
    assert peer.wait_notifs(striped.name, 1) == [b"hold-1"]  # from the main agent, once


@pytest.fixture
def quiet_striped(dst: SharedMemoryRegion) -> Iterator[StripedAgent]:
    """A striped agent with no progress thread: its workers move only as it polls them."""
    a = StripedAgent(unique("quiet"), stripes=2, progress_thread=False)
    a.register(dst)
    yield a
    a.close()
    assert a.live_handles() == ZERO


def _read(agent: StripedAgent, peer, dst, ranges) -> None:
    local, remote = read_tables(peer, dst, ranges)
    with agent.read(peer.name, local, remote) as xfer:
        assert xfer.wait(WAIT_S) is TransferState.DONE
    assert_landed(peer, dst, ranges)
    dst.host_view()[:] = SENTINEL


@pytest.mark.nixl
def test_a_small_read_needs_nothing_from_the_peer_once_both_endpoints_connected(peer, dst, striped):
    striped.add_remote(peer.metadata)
    assert striped.read_waits_on_peer(peer.name, 4096)  # nothing connected yet
    _read(striped, peer, dst, [(0, 0, 4096)])  # the main agent's: connects our notifications'
    assert striped.read_waits_on_peer(peer.name, 4096)
    _read(striped, peer, dst, [(0, 0, 4096)])  # the first stripe's
    assert not striped.read_waits_on_peer(peer.name, 4096)
    assert striped.read_waits_on_peer(peer.name, stripes.MIN_BYTES)  # a part on the main agent
    assert striped.read_waits_on_peer(peer.name, 4096, mem="VRAM")  # whole on the main agent
    assert striped.read_waits_on_peer(peer.name, 4096, remote_mem="VRAM")
    striped.remove_remote(peer.name)
    striped.add_remote(peer.metadata)
    assert striped.read_waits_on_peer(peer.name, 4096)  # reloaded: connects again
    plain = Agent(unique("plain"))
    try:
        assert plain.read_waits_on_peer(peer.name, 4096)  # one agent reads and notifies
    finally:
        plain.close()


@pytest.mark.nixl
def test_a_small_read_completes_while_a_peer_we_notified_does_not_progress(own_peer, dst, striped):
    # A READ behind our last notification on one endpoint completes only once the peer
    # progresses its UCX worker (kvxferd.sidecar.notifs); the stripe's endpoint carries none.
    striped.add_remote(own_peer.metadata)
    ranges = [(4096, 0, 4096), (0, 1 << 20, 8192)]
    _read(striped, own_peer, dst, ranges)  # connects the main agent (needs the peer)
    _read(striped, own_peer, dst, ranges)  # connects the first stripe (needs the peer)
    striped.send_notif(own_peer.name, b"hold-0")
    assert own_peer.wait_notifs(striped.name, 1) == [b"hold-0"]
    local, remote = read_tables(own_peer, dst, ranges)
    own_peer.pause(PAUSE_S)  # the peer neither polls nor progresses from now on
    paused_at = time.monotonic()
    with striped.read(own_peer.name, local, remote) as xfer:
        assert xfer.wait(PAUSE_S / 2) is TransferState.DONE
    assert time.monotonic() - paused_at < PAUSE_S  # done while the peer still slept
    assert_landed(own_peer, dst, ranges)
    assert striped.live_handles().transfers == 0


@pytest.mark.nixl
def test_a_notification_after_small_reads_leaves_without_our_progress(peer, dst, quiet_striped):
    # The first small READ from a peer goes on the main agent, whose endpoint our notifications
    # take: polled to its end it connects that endpoint, so a notification needs no poll of ours.
    quiet_striped.add_remote(peer.metadata)
    for i in range(3):
        _read(quiet_striped, peer, dst, [(0, 0, 4096)])
        quiet_striped.send_notif(peer.name, f"hold-{i}".encode())
        got = peer.wait_notifs(quiet_striped.name, i + 1, timeout_s=WAIT_S)
        assert got == [f"hold-{j}".encode() for j in range(i + 1)]


@pytest.mark.nixl
def test_a_part_that_cannot_be_posted_fails_the_read_once_the_others_settled(peer, dst, striped):
    striped.add_remote(peer.metadata)
    size = peer.src.size
    # The last third of the bytes lies past the peer's registered memory: that part's post fails.
    local = np.array([[dst.base_addr, size]], np.uint64)
    remote = np.array([[peer.remote_base + size // 2, size]], np.uint64)
    xfer = striped.read(peer.name, local, remote)
    try:
        polls = 0
        while xfer.poll() is TransferState.POSTED and polls < 10_000_000:
            polls += 1
        assert xfer.state is TransferState.FAILED
        assert isinstance(xfer.error, TransportLookupError)
    finally:
        xfer.release()
    assert striped.live_handles().transfers == 0


@pytest.mark.nixl
def test_a_read_whose_every_part_fails_raises_and_holds_nothing(peer, dst, striped):
    striped.add_remote(peer.metadata)
    local = np.array([[dst.base_addr, 2 << 20]], np.uint64)
    remote = np.array([[peer.remote_base + peer.src.size, 2 << 20]], np.uint64)
    with pytest.raises(TransportLookupError):
        striped.read(peer.name, local, remote)
    assert striped.live_handles().transfers == 0


@pytest.mark.nixl
def test_stripes_follow_registrations_and_peers(peer, dst, striped):
    striped.add_remote(peer.metadata)
    assert striped.live_handles().registrations == 3  # dst, on each of the three agents
    striped.remove_remote(peer.name)
    assert striped.remotes() == frozenset()
    for reg in list(striped._registrations.values()):
        striped.deregister(reg)
    assert striped.live_handles() == ZERO
