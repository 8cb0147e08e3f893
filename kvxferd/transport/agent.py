"""The sidecar's NIXL agent: registration, metadata, READs (plain and prepped), notifications.

This package is the only code that imports ``nixl``. Every NIXL exception leaves it as a
kvxferd error, and every handle it creates is counted so tests can prove nothing leaks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from kvxferd.errors import (
    DescriptorError,
    HandshakeError,
    RegistrationError,
    TransportError,
)
from kvxferd.memory import RegionSource
from kvxferd.transport import ucxenv
from kvxferd.transport.descs import TableLike, as_indices, as_xfer_table, check_pairs
from kvxferd.transport.nixl_errors import nixl_errors
from kvxferd.transport.prepped import PreppedList
from kvxferd.transport.registration import LiveHandles, Registration
from kvxferd.transport.transfer import Transfer

logger = logging.getLogger(__name__)

SyncMode = Literal["rw", "strict", "none"]


class Agent:
    """A NIXL agent owned by one sidecar; safe to call from several threads.

    ``progress_thread`` (default True) runs UCX progress in the background. A sidecar is both
    initiator (decode pulls) and target (prefill serves): a target that does not progress
    delays its peers' READ completion and notifications by its polling interval (50 ms polling
    measured as 50 ms per transfer), while dropping the thread only speeds up the initiator
    (about 2x on a 2-core host). So the default is on; pure initiators (benchmarks) may turn
    it off and busy-poll.

    ``sync_mode`` defaults to NIXL's RW lock because asyncio code calls the blocking NIXL
    functions from a thread pool; with several posting threads raise ``num_workers`` in
    ``backend_params={"UCX": {"num_workers": "N"}}``.
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = True,
        sync_mode: SyncMode = "rw",
        capture_telemetry: bool = True,
        num_threads: int = 0,
        backend_params: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        tx, rx = ucxenv.tcp_segments()
        if tx and rx and tx > rx:  # UCX would refuse to open its TCP transport, less clearly
            raise TransportError(
                f"create agent ({name}): UCX_TCP_TX_SEG_SIZE ({tx} B) exceeds "
                f"UCX_TCP_RX_SEG_SIZE ({rx} B); set the received size at least as large"
            )
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        modes = {
            "rw": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            "none": nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        }
        if sync_mode not in modes:
            raise TransportError(f"sync_mode must be one of {sorted(modes)}, got {sync_mode!r}")
        self.name = name
        """Agent name, unique among the peers."""
        self.capture_telemetry = capture_telemetry
        """Whether transfers report NIXL telemetry."""
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            capture_telemetry=capture_telemetry,
            backends=[],
            sync_mode=modes[sync_mode],
        )
        self.tcp_segments = (tx, rx)
        """Bytes per UCX TCP segment this agent sends and receives (0: not known)."""
        with nixl_errors("create agent", name):
            try:
                nx = nixl_agent(name, config)
            except RuntimeError as exc:  # raised by the wrapper when no plugin loads
                raise TransportError(f"create agent ({name}): {exc}") from exc
            for backend in backends:
                if backend not in nx.get_plugin_list():
                    raise TransportError(
                        f"create agent ({name}): backend {backend!r} not available, "
                        f"have {nx.get_plugin_list()}"
                    )
                params = dict(nx.get_plugin_params(backend))
                if num_threads > 0:
                    params["num_threads"] = str(num_threads)
                params.update((backend_params or {}).get(backend, {}))
                nx.create_backend(backend, params)
        self._nx: Any = nx
        self._lock = threading.RLock()
        self._transfers: set[Transfer] = set()
        self._prepped: set[PreppedList] = set()
        self._registrations: dict[tuple[str, int, int], Registration] = {}
        self._remotes: set[str] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._nx is None

    def _live_nx(self) -> Any:
        nx = self._nx
        if nx is None:
            raise TransportError(f"agent {self.name!r} is closed")
        return nx

    def live_handles(self) -> LiveHandles:
        """Counts of everything this agent still holds."""
        with self._lock:
            return LiveHandles(
                len(self._transfers),
                len(self._prepped),
                len(self._registrations),
                len(self._remotes),
            )

    def close(self) -> None:
        """Release transfers and prepped lists, deregister, drop remotes, free the agent.

        Idempotent; failures are logged and the rest is still released.
        """
        with self._lock:
            if self._nx is None:
                return
            for item in [*self._transfers, *self._prepped]:
                try:
                    item.release()
                except TransportError as exc:
                    logger.warning("agent %s: close could not release %r: %s", self.name, item, exc)
            for reg in list(self._registrations.values()):
                try:
                    self.deregister(reg)
                except TransportError as exc:
                    logger.warning("agent %s: close could not deregister: %s", self.name, exc)
            for remote in list(self._remotes):
                try:
                    self.remove_remote(remote)
                except TransportError as exc:
                    logger.warning(
                        "agent %s: close could not remove %s: %s", self.name, remote, exc
                    )
            self._transfers.clear()
            self._prepped.clear()
            self._registrations.clear()
            self._remotes.clear()
            self._nx = None

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- registration --------------------------------------------------------------------------

    def register(self, regions: RegionSource | Iterable[RegionSource]) -> list[Registration]:
        """Register each region once; all or nothing (earlier ones are undone on failure)."""
        items = [regions] if isinstance(regions, RegionSource) else list(regions)
        done: list[Registration] = []
        try:
            for region in items:
                done.append(self._register_one(region))
        except Exception:
            for reg in done:
                self.deregister(reg)
            raise
        return done

    def _register_one(self, region: RegionSource) -> Registration:
        nx = self._live_nx()
        reg = Registration(
            region.name,
            int(region.base_addr),
            int(region.size),
            region.mem,
            int(region.device_id),
        )
        with self._lock:
            if reg.key() in self._registrations:
                raise RegistrationError(
                    f"region {reg.name!r} ({reg.mem} @ {reg.base_addr:#x}) is already registered"
                )
            table = np.array([[reg.base_addr, reg.size, reg.device_id]], dtype=np.uint64)
            with nixl_errors("register", f"region {reg.name!r}", default=RegistrationError):
                reg.dlist = nx.register_memory(table, reg.mem)
            self._registrations[reg.key()] = reg
        return reg

    def deregister(self, reg: Registration) -> None:
        """Deregister a region. Idempotent."""
        with self._lock:
            if not reg.live or self._registrations.get(reg.key()) is not reg:
                return
            nx = self._live_nx()
            with nixl_errors("deregister", f"region {reg.name!r}", default=RegistrationError):
                nx.deregister_memory(reg.dlist)
            reg.dlist = None
            del self._registrations[reg.key()]

    # -- metadata ------------------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations) for a peer's add_remote."""
        with nixl_errors("get metadata", self.name):
            return bytes(self._live_nx().get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name (HandshakeError if unusable).

        Stale remote prepped lists of that name are released (NIXL invalidates them on reload).
        """
        nx = self._live_nx()
        try:
            with nixl_errors("add remote", f"{len(metadata)} B metadata"):
                raw = nx.add_remote_agent(metadata)
        except DescriptorError as exc:  # NIXL could not deserialise it
            raise HandshakeError(f"peer metadata ({len(metadata)} B) is unusable: {exc}") from exc
        try:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:  # NIXL takes any bytes as a name; we name peers in text
            with nixl_errors("remove remote", f"{raw[:64]!r}"):
                nx.remove_remote_agent(raw)  # else each try would leave it loaded
            raise HandshakeError(
                f"peer metadata ({len(metadata)} B) names its agent {raw[:64]!r}, not UTF-8"
            ) from None
        with self._lock:
            self._release_prepped_of(name)
            self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer and disconnect from it; its prepped lists are released. Idempotent."""
        with self._lock:
            if name not in self._remotes:
                return
            self._release_prepped_of(name)
            self._remotes.discard(name)
            with nixl_errors("remove remote", name):
                self._live_nx().remove_remote_agent(name)

    def remotes(self) -> frozenset[str]:
        """Names of the peers whose metadata is loaded."""
        with self._lock:
            return frozenset(self._remotes)

    def _release_prepped_of(self, remote: str) -> None:
        for item in [p for p in self._prepped if p.remote == remote]:
            try:
                item.release()
            except TransportError as exc:
                logger.warning("agent %s: releasing %r failed: %s", self.name, item, exc)
                self._prepped.discard(item)

    # -- READ ----------------------------------------------------------------------------------

    def read_waits_on_peer(self, remote: str, nbytes: int, *, mem: str = "DRAM",
                           remote_mem: str = "DRAM") -> bool:  # fmt: skip
        """:meth:`Transport.read_waits_on_peer`: always, one agent reads and notifies."""
        return True

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
    ) -> Transfer:
        """Post a READ of ``remote_descs`` (peer memory) into ``local`` (ours), row by row.

        Tables are Nx2 ``(addr, len)``, Nx3 or ``(addrs, lens)``; ``notif`` is delivered to the
        peer after the data. Returns the posted Transfer; the caller releases it.
        """
        loc = as_xfer_table(local, device_id, "local")
        rem = as_xfer_table(remote_descs, remote_device_id, "remote")
        check_pairs(loc, rem)
        nx = self._live_nx()
        subject = f"READ {loc.shape[0]} descs from {remote!r}"
        with nixl_errors("create", subject):
            local_dl = nx.get_xfer_descs(loc, mem)
            remote_dl = nx.get_xfer_descs(rem, remote_mem)
            handle = nx.initialize_xfer("READ", local_dl, remote_dl, remote, notif)
        return self._start(handle, remote, int(loc[:, 1].sum()), loc.shape[0])

    def prep_local(self, table: TableLike, *, mem: str = "DRAM", device_id: int = 0) -> PreppedList:
        """Prep a list over this agent's registered memory for :meth:`read_prepped`."""
        return self._prep(None, table, mem, device_id)

    def prep_remote(
        self, remote: str, table: TableLike, *, mem: str = "DRAM", device_id: int = 0
    ) -> PreppedList:
        """Prep a list over peer ``remote``'s memory (its metadata must be loaded)."""
        return self._prep(remote, table, mem, device_id)

    def _prep(self, remote: str | None, table: TableLike, mem: str, device_id: int) -> PreppedList:
        arr = as_xfer_table(table, device_id, "table")
        nx = self._live_nx()
        side = "NIXL_INIT_AGENT" if remote is None else remote
        with self._lock, nixl_errors("prep", f"{arr.shape[0]} descs for {side}"):
            handle = nx.prep_xfer_dlist(side, arr, mem)
            lens = arr[:, 1].copy()
            lens.flags.writeable = False
            prepped = PreppedList(
                handle, remote=remote, lens=lens, mem=mem, on_release=self._forget
            )
            self._prepped.add(prepped)
        return prepped

    def read_prepped(
        self,
        local: PreppedList,
        local_idx: np.ndarray | Sequence[int],
        remote: PreppedList,
        remote_idx: np.ndarray | Sequence[int],
        notif: bytes = b"",
    ) -> Transfer:
        """Post a READ of ``remote[remote_idx[i]]`` into ``local[local_idx[i]]`` for every i.

        Paired descriptors must have equal lengths (checked here, naming the first mismatch).
        """
        if not local.is_local or remote.is_local:
            raise DescriptorError("read_prepped needs a local list and a remote list, in order")
        li = as_indices(local_idx, local.count, "local_idx")
        ri = as_indices(remote_idx, remote.count, "remote_idx")
        if li.size != ri.size:
            raise DescriptorError(f"local_idx has {li.size} entries, remote_idx has {ri.size}")
        local_lens, remote_lens = local.lens[li], remote.lens[ri]
        diff = np.flatnonzero(local_lens != remote_lens)
        if diff.size:
            i = int(diff[0])
            raise DescriptorError(
                f"pair {i}: local[{int(li[i])}] has {int(local_lens[i])} B, "
                f"remote[{int(ri[i])}] has {int(remote_lens[i])} B"
            )
        nx = self._live_nx()
        assert remote.remote is not None
        subject = f"prepped READ {li.size} descs from {remote.remote!r}"
        with nixl_errors("create", subject):
            handle = nx.make_prepped_xfer(
                "READ", local.nixl_handle(), li, remote.nixl_handle(), ri, notif
            )
        return self._start(handle, remote.remote, int(local_lens.sum()), int(li.size))

    def _start(self, handle: Any, remote: str, nbytes: int, count: int) -> Transfer:
        xfer = Transfer(
            self._nx,
            handle,
            remote=remote,
            nbytes=nbytes,
            descriptors=count,
            capture_telemetry=self.capture_telemetry,
            on_release=self._forget,
        )
        with self._lock:
            self._transfers.add(xfer)
        try:
            xfer._post()
        except BaseException:
            try:
                xfer.release()
            except TransportError as exc:
                logger.warning("agent %s: releasing failed post: %s", self.name, exc)
            raise
        return xfer

    def _forget(self, item: Transfer | PreppedList) -> None:
        with self._lock:
            if isinstance(item, Transfer):
                self._transfers.discard(item)
            else:
                self._prepped.discard(item)

    # -- notifications -------------------------------------------------------------------------

    def send_notif(self, remote: str, message: bytes) -> None:
        """Send a standalone notification (needs ``remote``'s metadata loaded)."""
        with nixl_errors("send notif", f"to {remote!r}"):
            self._live_nx().send_notif(remote, message)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, keyed by the sender's agent name."""
        with nixl_errors("get notifs", self.name):
            try:
                raw = self._live_nx().get_new_notifs()
            except UnicodeDecodeError as exc:  # the bindings decode sender names as UTF-8
                raise TransportError(
                    f"get notifs ({self.name}): a sender's agent name is not UTF-8; NIXL "
                    f"dropped the notifications read with it [{exc}]"
                ) from exc
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): [bytes(m) for m in v]
            for k, v in raw.items()
        }
