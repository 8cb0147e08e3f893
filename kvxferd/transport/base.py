"""The transport seam: what the sidecar needs from a data plane, as two small protocols.

Five verbs: **register** memory, **prepare** descriptor lists, **read** (post a one-sided READ
that carries a notification), **notify** (a standalone notification) and **poll** (collect the
notifications received, which also progresses the transport). Peers are added by their
metadata and removed when they go away. :class:`kvxferd.transport.Agent` (NIXL over UCX) is
the implementation; the sidecar and its tests only rely on these protocols.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from kvxferd.errors import KvxferdError
from kvxferd.memory import RegionSource
from kvxferd.transport.registration import LiveHandles, Registration
from kvxferd.transport.transfer import TransferState


@runtime_checkable
class PostedRead(Protocol):
    """One posted READ: poll it (never blocks), release it once terminal."""

    @property
    def state(self) -> TransferState:
        """Last known state (POSTED, DONE or FAILED; only ever increases)."""
        ...

    @property
    def error(self) -> KvxferdError | None:
        """Why it failed, once it has."""
        ...

    def poll(self) -> TransferState:
        """Ask the transport once, without blocking; never raises for a failed READ."""
        ...

    def release(self) -> None:
        """Free the handle (idempotent). Releasing a POSTED READ does not stop its bytes."""
        ...

    def telemetry(self) -> dict[str, float | int] | None:
        """The transport's numbers for a DONE READ (``wall_s`` at least), or None."""
        ...


@runtime_checkable
class Transport(Protocol):
    """A sidecar's data plane (one per engine rank)."""

    name: str
    """This endpoint's name, unique among the peers (notifications are keyed by it)."""

    def register(self, regions: RegionSource | Iterable[RegionSource]) -> list[Registration]:
        """**register**: make regions readable by peers; all or nothing."""
        ...

    def prep_local(self, table: Any, *, mem: str = "DRAM", device_id: int = 0) -> Any:
        """**prepare**: a descriptor list over local memory, addressed later by index."""
        ...

    def prep_remote(self, remote: str, table: Any, *, mem: str = "DRAM",
                    device_id: int = 0) -> Any:  # fmt: skip
        """**prepare**: a descriptor list over a peer's memory."""
        ...

    def read(self, remote: str, local: Any, remote_descs: Any, notif: bytes = b"", *,
             mem: str = "DRAM", device_id: int = 0, remote_mem: str = "DRAM",
             remote_device_id: int = 0) -> PostedRead:  # fmt: skip
        """**read**: post a READ of ``remote_descs`` (the peer's, in ``remote_mem``) into
        ``local`` (ours, in ``mem``); the peer receives ``notif`` after the data. Posting may
        copy bytes (loopback/CMA)."""
        ...

    def read_waits_on_peer(self, remote: str, nbytes: int, *, mem: str = "DRAM",
                           remote_mem: str = "DRAM") -> bool:  # fmt: skip
        """Whether a plain :meth:`read` of this kind from ``remote`` (no notification) may
        complete only once that peer progresses its UCX worker: it shares an endpoint with our
        notifications to it (see kvxferd.sidecar.notifs), or its endpoint still connects.
        False: over CMA or RDMA it needs nothing from the peer."""
        ...

    def read_prepped(self, local: Any, local_idx: Any, remote: Any, remote_idx: Any,
                     notif: bytes = b"") -> PostedRead:  # fmt: skip
        """**read** by index: ``remote[remote_idx[i]]`` (a peer's prepared list) into
        ``local[local_idx[i]]`` (ours) for every i; ``notif`` as for :meth:`read`."""
        ...

    def send_notif(self, remote: str, message: bytes) -> None:
        """**notify**: a standalone notification to a peer (non-blocking)."""
        ...

    def get_notifs(self) -> dict[str, list[bytes]]:
        """**poll**: notifications received since the last call, by sender; progresses the
        transport (a peer's READ of our memory may need it to complete). Non-blocking."""
        ...

    def get_agent_metadata(self) -> bytes:
        """What a peer needs to reach us (``add_remote`` on its side)."""
        ...

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; its name."""
        ...

    def remove_remote(self, name: str) -> None:
        """Forget a peer and close the connection to it (idempotent)."""
        ...

    def live_handles(self) -> LiveHandles:
        """Counts of everything still held (all zero at rest)."""
        ...

    def close(self) -> None:
        """Release everything (idempotent)."""
        ...
