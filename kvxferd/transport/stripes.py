"""Large READs split across stripes: agents of their own, each posting its share from a thread.

On loopback UCX copies a READ inside its post (``process_vm_readv``, one thread), so one READ
runs at one core's copy speed: about 4.4 GB/s from shared memory here, 0.4x memcpy. Two agents
(each its own UCX worker and connection) posting halves from two threads moved 7.4-8.1 GB/s, as
two raw ``process_vm_readv`` threads do (``scripts/bench_lanes.py``). One agent with more UCX
workers does not: NIXL picks a worker by a hash of the posting thread, which need not differ.

A :class:`StripedAgent` is an :class:`Agent` with ``stripes - 1`` more agents that register the
same DRAM regions and load the same peers. A DRAM READ of at least ``MIN_BYTES`` without a
notification is cut into equal byte ranges (a row split where a cut falls inside it), one per
agent, posted at once; the caller gets one :class:`StripedRead`, which reports FAILED only
once no part can still write. Notifications, prepared lists and everything else stay on the
main agent, so peers see one reader.

A smaller DRAM READ without a notification goes whole on the first stripe, whose endpoints
never carry a notification: a READ behind our last notification to a peer completes only once
that peer progresses its UCX worker (kvxferd.sidecar.notifs), one on the stripe completes in its
post over CMA. So a pull can send its claim first and post the READ while the claim is out
(:meth:`StripedAgent.read_waits_on_peer`; at concurrency 1 the decode sidecar's pull took
0.82-0.86 ms instead of 1.02-1.11, scripts/bench_control.py). The first small READ from a peer
goes on the main agent all the same: it connects the endpoint our notifications to that peer
take (unconnected, a notification waits for our next progress, up to the poller's 50 ms). The
next one connects the stripe's; both need the peer's progress, so they are posted first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvxferd.errors import KvxferdError, TransportError
from kvxferd.memory import RegionSource
from kvxferd.transport.agent import Agent
from kvxferd.transport.descs import TableLike, as_xfer_table
from kvxferd.transport.registration import LiveHandles, Registration
from kvxferd.transport.transfer import Transfer, TransferState

logger = logging.getLogger(__name__)

MIN_BYTES = 8 << 20
"""READs smaller than this go whole, on the first stripe (a split costs a thread hop and a
post)."""
MAX_STRIPES = 8
"""Most stripes an agent takes."""


class _Failed:
    """A part whose post raised: FAILED from the start, nothing to release."""

    def __init__(self, error: KvxferdError) -> None:
        self.error: KvxferdError | None = error
        self.state = TransferState.FAILED

    def poll(self) -> TransferState:
        return self.state

    def release(self) -> None:
        pass

    def telemetry(self) -> dict[str, float | int] | None:
        return None


class StripedRead:
    """One READ posted as parts on several agents: DONE once every part is, FAILED once one
    failed and none is still POSTED (so nothing can write after FAILED is reported)."""

    def __init__(self, parts: Sequence[Transfer | _Failed]) -> None:
        self._parts = list(parts)
        self._state = TransferState.POSTED
        self.poll()

    @property
    def state(self) -> TransferState:
        """Last known state (only ever increases)."""
        return self._state

    @property
    def error(self) -> KvxferdError | None:
        """The first failed part's error, once the READ has failed."""
        if self._state is not TransferState.FAILED:
            return None
        return next(p.error for p in self._parts if p.state is TransferState.FAILED)

    def poll(self) -> TransferState:
        """Poll every part still POSTED; never raises for a failed READ."""
        if self._state is TransferState.POSTED:
            states = [p.poll() for p in self._parts]
            if TransferState.POSTED not in states:
                failed = TransferState.FAILED in states
                self._state = TransferState.FAILED if failed else TransferState.DONE
        return self._state

    def release(self) -> None:
        """Release every part (idempotent); the first error is raised after all were tried."""
        errors = []
        for part in self._parts:
            try:
                part.release()
            except TransportError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def telemetry(self) -> dict[str, float | int] | None:
        """Bytes and descriptors summed, times of the slowest part (the parts ran at once)."""
        parts = [p.telemetry() for p in self._parts]
        if self._state is not TransferState.DONE or any(t is None for t in parts):
            return None
        out: dict[str, float | int] = {"stripes": len(parts)}
        for t in parts:
            assert t is not None
            for key, value in t.items():
                summed = key in ("bytes", "descriptors")
                out[key] = out.get(key, 0) + value if summed else max(out.get(key, 0), value)
        return out

    def __repr__(self) -> str:
        return f"StripedRead({len(self._parts)} parts, {self._state.name})"


def cut(table: np.ndarray, k: int) -> list[tuple[int, int, int, int]]:
    """Where ``k`` equal byte ranges of ``table`` (N x 3: addr, len, dev) start and end:
    ``(first row, bytes into it, last row, bytes of it taken)`` per range, rows inclusive."""
    lens = table[:, 1].astype(np.int64)
    ends = np.cumsum(lens)
    total = int(ends[-1])
    out = []
    for j in range(k):
        a, b = total * j // k, total * (j + 1) // k
        first = int(np.searchsorted(ends, a, side="right"))
        last = int(np.searchsorted(ends, b, side="left"))
        start_first = int(ends[first] - lens[first])
        start_last = int(ends[last] - lens[last])
        out.append((first, a - start_first, last, b - start_last))
    return out


def piece(table: np.ndarray, where: tuple[int, int, int, int]) -> np.ndarray:
    """The rows of ``table`` one range of :func:`cut` covers, the end rows clipped."""
    first, skip, last, take = where
    rows = table[first : last + 1].copy()
    rows[-1, 1] = take  # the last row ends at the cut (it may also be the first)
    rows[0, 0] += np.uint64(skip)
    rows[0, 1] -= np.uint64(skip)
    return rows


class StripedAgent(Agent):
    """An :class:`Agent` that posts large DRAM READs in ``stripes`` parts at once."""

    def __init__(self, name: str, *, stripes: int = 2, **kwargs: Any) -> None:
        if not 2 <= stripes <= MAX_STRIPES:
            raise TransportError(f"stripes must be in [2, {MAX_STRIPES}], got {stripes}")
        super().__init__(name, **kwargs)
        self._stripes: list[Agent] = []
        self._stripe_regs: dict[tuple[str, int, int], list[Registration]] = {}
        # Peers the main agent / the first stripe posted a READ to since they were loaded:
        # that endpoint is connected, or connecting as the READ is polled to its end.
        self._main_read: set[str] = set()
        self._stripe_read: set[str] = set()
        try:
            for i in range(1, stripes):
                self._stripes.append(Agent(f"{name}~{i}", **kwargs))
        except BaseException:
            self.close()
            raise
        self._posters = ThreadPoolExecutor(stripes - 1, thread_name_prefix="kvxferd-stripe")

    def _register_one(self, region: RegionSource) -> Registration:
        reg = super()._register_one(region)
        if region.mem != "DRAM":
            return reg
        done: list[Registration] = []
        try:
            for stripe in self._stripes:
                done += stripe.register(region)
        except BaseException:
            for stripe, sreg in zip(self._stripes, done, strict=False):
                stripe.deregister(sreg)
            super().deregister(reg)
            raise
        self._stripe_regs[reg.key()] = done
        return reg

    def deregister(self, reg: Registration) -> None:
        for stripe, sreg in zip(self._stripes, self._stripe_regs.pop(reg.key(), ()), strict=False):
            stripe.deregister(sreg)  # VRAM regions have none
        super().deregister(reg)

    def add_remote(self, metadata: bytes) -> str:
        name = super().add_remote(metadata)
        self._main_read.discard(name)  # a reloaded peer connects again
        self._stripe_read.discard(name)
        try:
            for stripe in self._stripes:
                stripe.add_remote(metadata)
        except BaseException:
            self.remove_remote(name)
            raise
        return name

    def remove_remote(self, name: str) -> None:
        self._main_read.discard(name)
        self._stripe_read.discard(name)
        for stripe in self._stripes:
            stripe.remove_remote(name)
        super().remove_remote(name)

    def live_handles(self) -> LiveHandles:
        counts = [super().live_handles(), *(s.live_handles() for s in self._stripes)]
        return LiveHandles(*(sum(c[i] for c in counts) for i in range(len(counts[0]))))

    def close(self) -> None:
        posters = getattr(self, "_posters", None)
        if posters is not None:
            posters.shutdown(wait=True)
        for stripe in getattr(self, "_stripes", []):
            stripe.close()
        super().close()

    def read_waits_on_peer(self, remote: str, nbytes: int, *, mem: str = "DRAM",
                           remote_mem: str = "DRAM") -> bool:  # fmt: skip
        """Not for a DRAM READ below MIN_BYTES once the main agent and the first stripe both
        read from ``remote`` since it was loaded: it goes on the first stripe, which never
        notifies, over a connected endpoint (a larger READ has a part on the main agent, VRAM
        goes whole on it, and the first READs connect)."""
        small = (mem, remote_mem) == ("DRAM", "DRAM") and nbytes < MIN_BYTES
        return not (small and remote in self._main_read and remote in self._stripe_read)

    def read(
        self,
        remote: str,
        local: TableLike,
        remote_descs: TableLike,
        notif: bytes = b"",
        *,
        mem: str = "DRAM",
        device_id: int = 0,
        remote_mem: str = "DRAM",
        remote_device_id: int = 0,
    ) -> Any:
        """:meth:`Agent.read`; a DRAM READ of at least MIN_BYTES with no notification goes in
        one part per stripe, posted at once (a :class:`StripedRead`), a smaller one whole on
        the first stripe."""
        whole = (mem, remote_mem) != ("DRAM", "DRAM") or bool(notif)
        loc = local if whole else as_xfer_table(local, device_id, "local")
        if whole or int(loc[:, 1].sum()) < MIN_BYTES:  # the table as converted, not again
            # A small one goes on the first stripe, away from our notifications (module
            # docstring), once the main agent's first READ from the peer connected the endpoint
            # they take: unconnected, a notification would wait on our own progress.
            on_stripe = not whole and remote in self._main_read
            agent = self._stripes[0] if on_stripe else super()
            xfer = agent.read(remote, loc, remote_descs, notif, mem=mem, device_id=device_id,
                              remote_mem=remote_mem, remote_device_id=remote_device_id)  # fmt: skip
            (self._stripe_read if on_stripe else self._main_read).add(remote)
            return xfer
        rem = as_xfer_table(remote_descs, remote_device_id, "remote")
        agents: list[Agent] = [self, *self._stripes]
        ranges = cut(loc, len(agents))

        def post(i: int) -> Transfer | _Failed:
            agent = super(StripedAgent, self) if i == 0 else agents[i]
            try:
                return agent.read(remote, piece(loc, ranges[i]), piece(rem, ranges[i]))
            except KvxferdError as exc:
                return _Failed(exc)
            except Exception as exc:  # no part may be left unsettled by an error of another
                return _Failed(TransportError(f"striped READ part {i}: {exc!r}"))

        futures = [self._posters.submit(post, i) for i in range(1, len(agents))]
        parts = [post(0), *(f.result() for f in futures)]
        if all(isinstance(p, _Failed) for p in parts):
            raise parts[0].error  # type: ignore[misc]  # nothing was posted: nothing to settle
        self._main_read.add(remote)  # both posted a part: their endpoints connect
        self._stripe_read.add(remote)
        return StripedRead(parts)
