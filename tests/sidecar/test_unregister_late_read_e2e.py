"""A READ the prefill still serves after its unregister reads no memory that was let go of.

Over UCX's TCP transport the prefill's own UCX worker serves a READ: it copies the blocks into
GET replies as its socket to the reader drains. A reader stalled mid-READ (SIGSTOP) leaves those
replies queued past its claim's end; the unregister then waited for the claim to end, unmapped
the engine's memory, and when the reader resumed the prefill copied from unmapped pages and
died of SIGSEGV.

Deterministic, with no timing: the prefill is stopped while the decode posts its READ and
sends its claim (both wait in the prefill's sockets), then the decode is stopped and the
prefill resumed, so the prefill records the claim and fills both sockets' buffers with a READ
far larger than they hold. Each step waits (bounded) for what the kernel's TCP queues show.
The prefill's unregister now leaves zero pages where the memory was
(``kvxferd.memory.placeholder``): the rest of the READ copies zeros.
"""

from __future__ import annotations

import os
import signal

import pytest

from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.wire import HoldRequest, PullRequest
from tests.sidecar.harness import (
    EnginePool,
    metric,
    plan,
    start_sidecar,
    wait_no_handles,
    wait_until,
)
from tests.store.helpers import DENSE, block_ids

pytestmark = pytest.mark.nixl

TCP = {"UCX_TLS": "tcp"}
"""READs over UCX's TCP transport, served by the prefill's UCX worker (over CMA, the loopback
default, the decode's process copies and the prefill serves nothing)."""
BLOCKS = 40
"""Blocks of the pools (2 MiB each for this model): a READ of 76 MiB, far past what the two
sockets' buffers hold, so most of it is still to be copied when the decode stops."""
QUEUED = 1 << 20
"""Bytes of GET replies queued in the prefill's sockets that show it stuck mid-READ."""


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _tcp(pid: int) -> list[tuple[int, int, int, int]]:
    """``(local port, remote port, send queue, receive queue)`` of each established TCP
    connection of process ``pid`` (from /proc/net/tcp*, matched by socket inode)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "01" or cols[9] not in inodes:  # 01: ESTABLISHED
                    continue
                tx, rx = (int(q, 16) for q in cols[4].split(":"))
                out.append((int(cols[1].rsplit(":", 1)[1], 16),
                            int(cols[2].rsplit(":", 1)[1], 16), tx, rx))  # fmt: skip
    return out


def test_a_read_stalled_past_the_unregister_fails_gets_zeros_and_the_prefill_lives(tmp_path):
    pm, dm = plan(DENSE, num_blocks=BLOCKS), plan(DENSE, num_blocks=BLOCKS)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    tokens = (BLOCKS - 2) * pm.groups[0].block_size
    pids, dids = block_ids(pm, tokens, descending=True), block_ids(dm, tokens)
    write_pattern(pm, ppool.views, pids, seed=7)
    p = start_sidecar(str(tmp_path), "prefill", "--max-claim", "1", env=TCP)
    d = start_sidecar(str(tmp_path), "decode", env=TCP)
    api = {_port(p.peer), _port(p.peer_frames)}
    frames = _port(p.peer_frames)
    stopped: list[int] = []

    def stop(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    def resume(pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        stopped.remove(pid)

    try:
        with p.client() as pc, d.client() as dc:
            registered = pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            # The same READ once whole: it connects every UCX endpoint the stalled one uses.
            ticket = pc.hold(HoldRequest(request_id="warm", block_ids=pids, num_tokens=tokens))
            done = dc.run_pull(PullRequest(tickets=[ticket], block_ids=dids, deadline_s=30))
            assert done.state == "done", done
            assert verify_pattern(dm, dpool.views, dids, seed=7) is None

            ticket = pc.hold(HoldRequest(request_id="late", block_ids=pids, num_tokens=tokens))
            stop(p.child.pid)
            pull = dc.pull(PullRequest(tickets=[ticket], block_ids=dids, deadline_s=30))
            wait_until(lambda: any(local == frames and rx for local, _, _, rx in _tcp(p.child.pid)),
                       what="the claim waiting in the stopped prefill's socket")  # fmt: skip
            wait_until(lambda: metric(d.peer, "kvxferd_nixl_handles") > 0,
                       what="the decode's READ posted")  # fmt: skip
            stop(d.child.pid)
            resume(p.child.pid)
            wait_until(lambda: any(remote == frames and rx for _, remote, _, rx in
                                   _tcp(d.child.pid)), what="the claim's answer")  # fmt: skip
            wait_until(lambda: sum(tx for local, _, tx, _ in _tcp(p.child.pid)
                                   if local not in api) > QUEUED,
                       what="GET replies queued behind the stopped decode")  # fmt: skip

            pc.unregister(registered.generation)  # once the claim ended (1 s), unnotified
            assert metric(p.peer, "kvxferd_holds_released_total", reason="expired") == 1
            resume(d.child.pid)
            status = dc.wait_pull(pull.pull_id, timeout_s=60)
            assert status.state == "failed", status
            assert p.child.alive(), p.child.output()[-3000:]
            # The READ's rest was copied from zero pages, not the engine's memory (which still
            # holds the pattern the warm-up left in these very decode blocks).
            wait_no_handles(d)
            wrong = verify_pattern(dm, dpool.views, dids, seed=7)
            assert wrong is not None and wrong.actual == 0, wrong

            # The prefill serves on: a new registration's blocks arrive byte-exact.
            registered = pc.register(pm, ppool.specs())
            ticket = pc.hold(HoldRequest(request_id="after", block_ids=pids, num_tokens=tokens))
            dpool.views[0][:] = 0
            done = dc.run_pull(PullRequest(tickets=[ticket], block_ids=dids, deadline_s=30))
            assert done.state == "done", done
            assert verify_pattern(dm, dpool.views, dids, seed=7) is None
    finally:
        for pid in list(stopped):
            resume(pid)
        codes = (p.stop(), d.stop())
        ppool.close()
        dpool.close()
    assert codes == (0, 0)  # the prefill was not killed by SIGSEGV (-11)
