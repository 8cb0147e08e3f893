"""Agent against a real target process: READs land byte-exactly, notifications arrive keyed by
the initiator, failures surface as kvxferd errors, and every handle is released."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvxferd.errors import (
    DescriptorError,
    HandshakeError,
    PeerDisconnectedError,
    RegistrationError,
    TransferTimeoutError,
    TransportError,
    TransportLookupError,
)
from kvxferd.memory import SharedMemoryRegion
from kvxferd.transport import Agent, LiveHandles, TransferState
from tests.transport.conftest import assert_landed, read_tables, unique

pytestmark = pytest.mark.nixl

WAIT_S = 20.0
ZERO = LiveHandles(0, 0, 0, 0)

# (src offset, dst offset, length): scattered, unaligned, not in order.
RANGES = [(0, 4096, 512), (1_000_003, 17, 4096), (3 << 20, 1 << 20, 65536), (12345, 2 << 20, 1)]


def test_read_of_scattered_ranges_lands_byte_exact_and_touches_nothing_else(peer, dst, agent):
    agent.add_remote(peer.metadata)
    local, remote = read_tables(peer, dst, RANGES)
    with agent.read(peer.name, local, remote) as xfer:
        assert xfer.wait(WAIT_S) is TransferState.DONE
        assert xfer.nbytes == sum(n for *_, n in RANGES)
    assert_landed(peer, dst, RANGES)
    assert agent.live_handles().transfers == 0


def test_read_accepts_separate_addr_and_len_arrays(peer, dst, agent):
    agent.add_remote(peer.metadata)
    local, remote = read_tables(peer, dst, RANGES)
    with agent.read(peer.name, (local[:, 0], local[:, 1]), (remote[:, 0], remote[:, 1])) as xfer:
        xfer.wait(WAIT_S)
    assert_landed(peer, dst, RANGES)


def test_prepped_read_by_index_lands_byte_exact(peer, dst, agent):
    name = agent.add_remote(peer.metadata)
    block, blocks = 4096, 64
    local_table = np.array([[dst.base_addr + i * block, block] for i in range(blocks)], np.uint64)
    remote_table = np.array(
        [[peer.remote_base + i * block, block] for i in range(blocks)], np.uint64
    )
    rng = np.random.default_rng(3)
    remote_idx = rng.permutation(blocks)[:20]
    local_idx = rng.permutation(blocks)[:20]
    with agent.prep_local(local_table) as lp, agent.prep_remote(name, remote_table) as rp:
        assert agent.live_handles().prepped == 2
        with agent.read_prepped(lp, local_idx, rp, remote_idx) as xfer:
            xfer.wait(WAIT_S)
            assert xfer.nbytes == 20 * block
    pairs = zip(local_idx, remote_idx, strict=True)
    ranges = [(int(r) * block, int(d) * block, block) for d, r in pairs]
    assert_landed(peer, dst, ranges)
    assert agent.live_handles() == LiveHandles(0, 0, 1, 1)


def test_notification_of_a_read_arrives_keyed_by_initiator_name(peer, dst, agent):
    agent.add_remote(peer.metadata)
    local, remote = read_tables(peer, dst, RANGES[:1])
    with agent.read(peer.name, local, remote, b"req-1:done") as xfer:
        xfer.wait(WAIT_S)
    agent.send_notif(peer.name, b"standalone")
    assert peer.wait_notifs(agent.name, 2) == [b"req-1:done", b"standalone"]


def test_telemetry_reports_bytes_and_durations(peer, dst, agent):
    agent.add_remote(peer.metadata)
    local, remote = read_tables(peer, dst, RANGES)
    with agent.read(peer.name, local, remote) as xfer:
        assert xfer.telemetry() is None or xfer.state is TransferState.DONE
        xfer.wait(WAIT_S)
        tel = xfer.telemetry()
    assert tel is not None
    assert tel["bytes"] == xfer.nbytes
    assert 1 <= tel["descriptors"] <= len(RANGES)
    assert tel["transfer_s"] >= 0 and tel["post_s"] >= 0 and tel["wall_s"] > 0


def test_reads_from_several_threads_all_land(peer, dst, agent):
    agent.add_remote(peer.metadata)
    errors: list[BaseException] = []
    chunk = 64 << 10

    def worker(i: int) -> None:
        try:
            ranges = [(i * 8 * chunk + k * chunk, (i * 8 + k) * chunk, chunk) for k in range(8)]
            local, remote = read_tables(peer, dst, ranges)
            for _ in range(5):
                with agent.read(peer.name, local, remote) as xfer:
                    xfer.wait(WAIT_S)
        except BaseException as exc:  # collected and re-raised by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert not errors, errors
    assert_landed(peer, dst, [(k * chunk, k * chunk, chunk) for k in range(32)])
    assert agent.live_handles().transfers == 0


def test_read_from_unknown_agent_is_a_lookup_error_and_leaks_nothing(dst, agent):
    table = np.array([[dst.base_addr, 64]], np.uint64)
    with pytest.raises(TransportLookupError, match="nobody"):
        agent.read("nobody", table, table)
    assert agent.live_handles() == LiveHandles(0, 0, 1, 0)


def test_unusable_peer_metadata_is_a_handshake_error(agent):
    with pytest.raises(HandshakeError, match="4 B"):
        agent.add_remote(b"junk")
    assert agent.live_handles().remotes == 0


def test_read_outside_the_peers_registered_memory_is_a_lookup_error(peer, dst, agent):
    agent.add_remote(peer.metadata)
    local = np.array([[dst.base_addr, 64]], np.uint64)
    remote = np.array([[peer.remote_base + peer.src.size, 64]], np.uint64)
    with pytest.raises(TransportLookupError, match="registration"):
        agent.read(peer.name, local, remote)
    assert agent.live_handles().transfers == 0


def test_mismatched_descriptor_lengths_are_rejected_before_nixl(peer, dst, agent):
    agent.add_remote(peer.metadata)
    local = np.array([[dst.base_addr, 64], [dst.base_addr + 64, 64]], np.uint64)
    remote = np.array([[peer.remote_base, 64], [peer.remote_base + 64, 32]], np.uint64)
    with pytest.raises(DescriptorError, match="descriptor 1: local length 64 != remote length 32"):
        agent.read(peer.name, local, remote)


def test_prepped_index_out_of_range_and_length_mismatch_are_rejected(peer, dst, agent):
    name = agent.add_remote(peer.metadata)
    lt = np.array([[dst.base_addr, 64], [dst.base_addr + 64, 128]], np.uint64)
    rt = np.array([[peer.remote_base, 64]], np.uint64)
    with agent.prep_local(lt) as lp, agent.prep_remote(name, rt) as rp:
        with pytest.raises(DescriptorError, match=r"remote_idx\[0\] = 1 is outside \[0, 1\)"):
            agent.read_prepped(lp, [0], rp, [1])
        with pytest.raises(DescriptorError, match="local\\[1\\] has 128 B, remote\\[0\\] has 64"):
            agent.read_prepped(lp, [1], rp, [0])
        with pytest.raises(DescriptorError, match="local list and a remote list"):
            agent.read_prepped(rp, [0], lp, [0])
    assert agent.live_handles().transfers == 0


def test_removing_a_remote_releases_its_prepped_lists(peer, dst, agent):
    name = agent.add_remote(peer.metadata)
    lp = agent.prep_local(np.array([[dst.base_addr, 64]], np.uint64))
    rp = agent.prep_remote(name, np.array([[peer.remote_base, 64]], np.uint64))
    agent.remove_remote(name)
    assert rp.released and not lp.released
    assert agent.live_handles() == LiveHandles(0, 1, 1, 0)
    with pytest.raises(TransportLookupError, match="released"):
        agent.read_prepped(lp, [0], rp, [0])
    agent.remove_remote(name)  # idempotent
    lp.release()
    lp.release()
    assert agent.live_handles() == LiveHandles(0, 0, 1, 0)


def test_reloading_a_remotes_metadata_releases_its_stale_prepped_lists(peer, dst, agent):
    name = agent.add_remote(peer.metadata)
    rp = agent.prep_remote(name, np.array([[peer.remote_base, 64]], np.uint64))
    assert agent.add_remote(peer.metadata) == name
    assert rp.released
    assert agent.live_handles() == LiveHandles(0, 0, 1, 1)


def test_registering_a_region_twice_fails_and_a_failed_batch_is_undone(dst):
    with Agent(unique("reg")) as a:
        (reg,) = a.register(dst)
        with pytest.raises(RegistrationError, match="already registered"):
            a.register(dst)
        with SharedMemoryRegion.create(unique("kvx-extra"), 4096) as extra:
            with pytest.raises(RegistrationError, match=dst.name):
                a.register([extra, dst])
            assert a.live_handles().registrations == 1
            a.deregister(reg)
            a.deregister(reg)  # idempotent
            assert not reg.live and a.live_handles().registrations == 0
            regs = a.register([extra, dst])
            assert [r.name for r in regs] == [extra.name, dst.name]
            assert a.live_handles().registrations == 2


def test_close_releases_everything_and_is_idempotent(peer, dst):
    a = Agent(unique("close"))
    a.register(dst)
    name = a.add_remote(peer.metadata)
    a.prep_local(np.array([[dst.base_addr, 64]], np.uint64))
    a.prep_remote(name, np.array([[peer.remote_base, 64]], np.uint64))
    xfer = a.read(name, np.array([[dst.base_addr, 64]]), np.array([[peer.remote_base, 64]]))
    assert a.live_handles() == LiveHandles(1, 2, 1, 1)
    a.close()
    assert a.live_handles() == ZERO
    assert xfer.released
    a.close()
    assert a.closed
    with pytest.raises(TransportError, match="closed"):
        a.get_agent_metadata()


def test_a_read_that_cannot_complete_times_out_then_completes(own_peer, dst, agent):
    # The target has no progress thread: a READ carrying a notification cannot complete on
    # the initiator while the target does not poll NIXL, which makes the timeout deterministic.
    agent.add_remote(own_peer.metadata)
    local, remote = read_tables(own_peer, dst, RANGES)
    own_peer.pause(1.0)
    with agent.read(own_peer.name, local, remote, b"late") as xfer:
        with pytest.raises(TransferTimeoutError, match="deadline"):
            xfer.wait(0.2)
        assert xfer.state is TransferState.POSTED
        assert xfer.wait(WAIT_S) is TransferState.DONE
    assert_landed(own_peer, dst, RANGES)


def test_killed_peer_surfaces_as_peer_disconnected(own_peer, dst, agent):
    agent.add_remote(own_peer.metadata)
    local, remote = read_tables(own_peer, dst, RANGES[:1])
    with agent.read(own_peer.name, local, remote) as xfer:
        xfer.wait(WAIT_S)
    own_peer.kill()
    raised = None
    for _ in range(200):  # bounded: each attempt fails fast or completes
        try:
            with agent.read(own_peer.name, local, remote, b"x") as xfer:
                xfer.wait(WAIT_S)
        except PeerDisconnectedError as exc:
            raised = exc
            break
    assert raised is not None, "a READ from a killed peer kept succeeding"
    assert own_peer.name in str(raised)
    assert agent.live_handles().transfers == 0
    agent.remove_remote(own_peer.name)
    assert agent.live_handles().remotes == 0


def test_a_peer_whose_agent_name_is_not_utf8_is_a_handshake_error_and_not_kept_loaded(agent):
    """NIXL takes any bytes as a name, we name peers in text: such metadata (a hostile handshake
    answer) is refused, and NIXL keeps nothing of it (no endpoint left behind per try)."""
    name = b"stranger-\xff\xfe"
    with Agent(name, progress_thread=False) as stranger:  # type: ignore[arg-type]
        for _ in range(2):
            with pytest.raises(HandshakeError, match="not UTF-8"):
                agent.add_remote(stranger.get_agent_metadata())
    assert agent.live_handles().remotes == 0
    with pytest.raises(TransportLookupError):
        agent.send_notif(name, b"x")  # type: ignore[arg-type]
