"""The staging buffer staged READs land in (kvxferd.descriptors.staging), registered once.

One anonymous DRAM mapping of ``staging_bytes``, registered with the transport on the first
pull that wants it (on a thread; pulls read direct meanwhile) and cut into 64 KiB pages. A pull
takes contiguous pages for its runs and gives them back once its READ can no longer write
(kvxferd.sidecar.reads); one that finds no room reads direct. Pages under a READ that could not
be confirmed stopped (unsettled, quarantined) are retired: never handed out while it may write,
restored once it ends on its own (DONE or FAILED); one given up keeps them retired until the
pool closes, and the mapping then stays mapped for the life of the process. A large
scatter (over INLINE_BYTES) runs on the pool's own thread, awaited to its end even when the
pull is cancelled meanwhile, so a pull never reports while its scatter still writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.staging import StagedPlan, scatter
from kvxferd.errors import KvxferdError
from kvxferd.sidecar.reads import INLINE_BYTES, run_to_end
from kvxferd.transport.base import Transport

log = logging.getLogger(__name__)

PAGE = 64 << 10
"""Bytes of one staging page (a pull takes whole, contiguous pages)."""


class _Mapping:
    """Anonymous DRAM as a :class:`kvxferd.memory.RegionSource` (private to this process)."""

    mem = "DRAM"
    device_id = 0

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self._mmap: mmap.mmap | None = mmap.mmap(-1, size)
        self.view = np.frombuffer(self._mmap, dtype=np.uint8)
        self.base_addr = int(self.view.ctypes.data)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def host_view(self) -> np.ndarray:
        return self.view

    def backed_bytes(self) -> int:
        return self.size

    def close(self) -> None:
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            del self.view
            try:
                mapping.close()
            except BufferError:  # a view is still referenced: unmapped when it is dropped
                log.debug("staging buffer still has views; unmapped when they are dropped")


@dataclass(eq=False)
class Lease:
    """Pages of the staging buffer one pull holds: its bytes at ``addr`` (view: ``view``)."""

    first: int
    pages: int
    addr: int
    view: np.ndarray
    opening: int
    """The pool's opening it came from (a lease of an earlier one is never restored)."""
    retired: bool = False
    """Out of use, its pages not given back (its READ may still write)."""
    ended: bool = False
    """Its quarantined READ was seen ended (it can no longer write)."""


class StagingPool:
    """Bounded staging memory for the pulls of one sidecar (``nbytes``; 0: never staged)."""

    def __init__(
        self,
        transport: Transport,
        nbytes: int,
        name: str = "kvxferd-staging",
        on_retired: Callable[[int], None] | None = None,
    ) -> None:
        self._transport = transport
        self._on_retired = on_retired  # told retired_bytes on each change (the gauge)
        self.nbytes = nbytes // PAGE * PAGE
        self._name = name
        self._mapping: _Mapping | None = None
        self._registration: object | None = None
        self._opening: asyncio.Task[None] | None = None
        self._used = np.zeros(self.nbytes // PAGE, dtype=bool)
        self._leases = 0
        self._opening_no = 0  # bumped on close: leases of an earlier opening are stale
        self.retired = 0
        """Pages never handed out again (under a READ that may still write them)."""
        self.staged = 0
        """Leases handed out (pulls staged)."""
        self.no_room = 0
        """Pulls that wanted staging and found no room (read direct)."""
        self._executor: ThreadPoolExecutor | None = None

    @property
    def enabled(self) -> bool:
        """Whether pulls may stage at all (a nonzero size)."""
        return self.nbytes > 0

    @property
    def retired_bytes(self) -> int:
        """Bytes of the retired pages (at ``nbytes``: no pull is staged until the pool closes)."""
        return self.retired * PAGE

    def acquire(self, nbytes: int) -> Lease | None:
        """Contiguous pages for ``nbytes``, or None (read direct): the buffer not registered
        yet (this starts its registration), or no room now."""
        if not self.enabled or nbytes > self.nbytes:
            return None
        mapping = self._mapping
        if mapping is None or self._registration is None:
            if self._opening is None:
                self._opening = asyncio.get_running_loop().create_task(self._open())
            return None
        need = -(-nbytes // PAGE)
        free = np.r_[0, np.cumsum(~self._used)]
        fits = np.flatnonzero(free[need:] - free[:-need] == need)
        if fits.size == 0:
            self.no_room += 1
            return None
        first = int(fits[0])
        self._used[first : first + need] = True
        self._leases += 1
        self.staged += 1
        at = first * PAGE
        view = mapping.view[at : at + need * PAGE]
        return Lease(first, need, mapping.base_addr + at, view, self._opening_no)

    def release(self, lease: Lease) -> None:
        """Give ``lease`` back: its READ can no longer write."""
        self._used[lease.first : lease.first + lease.pages] = False
        self._leases -= 1

    def retire(self, lease: Lease) -> None:
        """Keep ``lease``'s pages out of use until :meth:`restore` or the pool closes (its
        READ may still write). One whose READ was already seen ended is released instead."""
        if lease.ended:  # restore() came first: the quarantine saw it end before this report
            self.release(lease)
            return
        self._leases -= 1
        self.retired += lease.pages
        lease.retired = True
        self._report()
        log.warning("staging pages %d-%d retired (%d of %d now): a READ into them was not "
                    "confirmed stopped", lease.first, lease.first + lease.pages - 1,
                    self.retired, self._used.size)  # fmt: skip

    def restore(self, lease: Lease) -> None:
        """``lease``'s quarantined READ ended (it can no longer write): its retired pages come
        back (not retired yet: :meth:`retire` releases it). A lease from before the pool last
        closed is left alone (its pages were reset then)."""
        lease.ended = True
        if not lease.retired or lease.opening != self._opening_no:
            return
        lease.retired = False
        self._used[lease.first : lease.first + lease.pages] = False
        self.retired -= lease.pages
        self._report()
        log.info("staging pages %d-%d back (%d retired now): the READ into them ended",
                 lease.first, lease.first + lease.pages - 1, self.retired)  # fmt: skip

    def _report(self) -> None:
        if self._on_retired is not None:
            self._on_retired(self.retired_bytes)

    async def scatter(self, lease: Lease, views: Sequence[np.ndarray], plan: StagedPlan) -> None:
        """Copy ``plan``'s rows from ``lease`` into ``views``: on the loop when small, else on
        the pool's thread, awaited to its end even if the caller is cancelled meanwhile."""
        if plan.nbytes <= INLINE_BYTES:
            scatter(lease.view, views, plan)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvxferd-scatter")
        loop = asyncio.get_running_loop()
        await run_to_end(loop.run_in_executor(self._executor, scatter, lease.view, views, plan))

    async def _open(self) -> None:
        mapping: _Mapping | None = None
        try:  # the mapping too: a size the host cannot map (no overcommit of it) is said so
            mapping = _Mapping(self._name, self.nbytes)
            (reg,) = await asyncio.to_thread(self._transport.register, mapping)
        except BaseException as exc:
            if mapping is not None:
                mapping.close()
            if not isinstance(exc, (KvxferdError, OSError)):
                raise
            log.warning("no staging buffer (pulls read direct): %s", exc)
            return  # _opening stays set: not retried until the pool closes
        self._mapping, self._registration = mapping, reg

    async def close(self) -> None:
        """Deregister and unmap (after every pull ended; reusable afterwards: the next pull
        that wants staging registers afresh). Retired pages keep the mapping mapped."""
        opening, self._opening = self._opening, None
        if opening is not None:  # a registration on its thread ends first (not cancelled:
            with contextlib.suppress(Exception):  # its thread would register all the same)
                await run_to_end(opening)
        executor, self._executor = self._executor, None
        if executor is not None:  # every pull ended: no scatter runs
            executor.shutdown(wait=True)
        mapping, reg = self._mapping, self._registration
        self._mapping = self._registration = None
        if reg is not None:
            deregister = getattr(self._transport, "deregister", None)
            if deregister is not None:
                try:
                    deregister(reg)
                except KvxferdError as exc:
                    log.warning("could not deregister the staging buffer: %s", exc)
        if mapping is not None:
            if self.retired or self._leases:
                log.warning("staging buffer left mapped: %d pages retired, %d leases out",
                            self.retired, self._leases)  # fmt: skip
            else:
                mapping.close()
        self._used[:] = False
        self._leases = self.retired = 0
        self._opening_no += 1
        self._report()
