"""READs that fail closed: once ``Reads.read`` returns or raises, nothing it posted can write.

A posted READ is never abandoned. Cancelling the caller (a pull's deadline, shutdown) while a
READ is being posted or is in flight does not end ``read`` early: the post finishes, the
transfer is driven to a terminal state, and only then is its handle released and the
cancellation passed on. Why not just release it: NIXL 1.5.1 releases an in-flight handle by
``ucp_request_cancel`` + free, which UCX does not honour for RMA gets (the operation keeps going
and still lands its bytes), so a release is no proof that nothing will be written.

The bound: a READ gets ``SETTLE_S`` past its own deadline to reach DONE or FAILED. One that
does not (its peer is stopped: the READ carries a notification that only completes when the
target progresses) has its peer forgotten, which removes the NIXL remote agent and closes the
UCX endpoint, then ``ABORT_S`` more; only then is the handle released. On the loopback/CMA
path the bytes are copied inside the post itself (process_vm_readv), so what is left in flight
after the post is the completion notification, not data.

Small READs are posted inline on the loop (microseconds); large ones on a small dedicated
executor (never asyncio's default pool). Completion is awaited on the loop (CompletionPoller),
and each peer address gets at most ``per_peer`` READs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvxferd.errors import KvxferdError, TransferTimeoutError
from kvxferd.transport import TransferState
from kvxferd.transport.base import PostedRead, Transport
from kvxferd.transport.completion import CompletionPoller

log = logging.getLogger(__name__)
T = TypeVar("T")

SETTLE_S = 2.0
"""Seconds a READ may take past its deadline to reach DONE/FAILED before its peer is cut off."""
ABORT_S = 1.0
"""Seconds after cutting the peer off before the handle is released regardless."""
INLINE_BYTES = 4 << 20
"""Posts of at most this many bytes (and INLINE_DESCS descriptors) run on the loop."""
INLINE_DESCS = 1024
"""Posts of at most this many descriptors (and INLINE_BYTES) run on the loop."""
POST_THREADS = 2
"""Threads of the dedicated executor that posts large READs."""
PER_PEER = 8
"""READs in flight at once per peer address (more wait their turn)."""


async def run_to_end(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile; then re-raise the
    cancellation. For work that must not be abandoned half-way (posting, settling a READ)."""
    fut = asyncio.ensure_future(work)
    interrupted: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            if fut.done() and fut.cancelled():
                raise
            interrupted = exc
        except BaseException:  # noqa: BLE001 - fut's own error, raised below via fut.result()
            pass
    if interrupted is not None:
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation wins
        raise interrupted
    return fut.result()


def _posted(posting: asyncio.Future[PostedRead]) -> bool:
    """Whether the post ended with a transfer (which must then be settled)."""
    return posting.done() and not posting.cancelled() and posting.exception() is None


class Reads:
    """Posts, awaits and settles the READs of all pulls of one sidecar."""

    def __init__(
        self,
        agent: Transport,
        *,
        on_stuck: Callable[[str], Awaitable[None]],
        per_peer: int = PER_PEER,
    ) -> None:
        self._agent = agent
        self._on_stuck = on_stuck
        self._per_peer = per_peer
        self.poller = CompletionPoller()
        self._executor: ThreadPoolExecutor | None = None
        self._slots: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}
        self.stuck = 0
        """READs that did not settle within SETTLE_S and had their peer cut off."""

    @contextlib.asynccontextmanager
    async def _slot(self, address: str) -> AsyncIterator[None]:
        """One of ``per_peer`` places for ``address``; the table only holds peers in use."""
        entry = self._slots.get(address)
        if entry is None:
            entry = self._slots[address] = (asyncio.Semaphore(self._per_peer), [0])
        entry[1][0] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1][0] -= 1
            if entry[1][0] == 0:
                del self._slots[address]

    def _post(self, args: tuple[Any, ...], nbytes: int, descs: int) -> asyncio.Future[PostedRead]:
        loop = asyncio.get_running_loop()
        if nbytes <= INLINE_BYTES and descs <= INLINE_DESCS:
            fut: asyncio.Future[PostedRead] = loop.create_future()
            try:
                fut.set_result(self._agent.read(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                fut.set_exception(exc)
            return fut
        if self._executor is None:
            self._executor = ThreadPoolExecutor(POST_THREADS, thread_name_prefix="kvxferd-post")
        return loop.run_in_executor(self._executor, functools.partial(self._agent.read, *args))

    async def read(
        self,
        address: str,
        remote: str,
        local_descs: Any,
        remote_descs: Any,
        notif: bytes,
        *,
        nbytes: int,
        descs: int,
        deadline: float,
    ) -> PostedRead:
        """Post a READ from agent ``remote`` (at ``address``) and wait for it until ``deadline``
        (``time.monotonic()``). Returns the DONE transfer, released; raises otherwise, but
        only once the READ can no longer write (see the module docstring)."""
        async with self._slot(address):
            posting = self._post((remote, local_descs, remote_descs, notif), nbytes, descs)
            transfer: PostedRead | None = None
            try:
                transfer = await run_to_end(posting)
                await self.poller.wait(transfer, deadline)
                return transfer
            finally:
                if transfer is None and _posted(posting):
                    transfer = posting.result()
                if transfer is not None:
                    await run_to_end(self._settle(transfer, address))

    async def _settle(self, transfer: PostedRead, address: str) -> None:
        """Bring ``transfer`` to a terminal state (bounded), then release its handle."""
        if transfer.state is TransferState.POSTED:
            try:
                await self.poller.wait(transfer, time.monotonic() + SETTLE_S)
            except TransferTimeoutError:
                self.stuck += 1
                log.warning("%r still in flight %.1f s past its deadline: cutting %s off",
                            transfer, SETTLE_S, address)  # fmt: skip
                try:
                    await self._on_stuck(address)
                    await self.poller.wait(transfer, time.monotonic() + ABORT_S)
                except KvxferdError as exc:
                    log.info("%r after cutting %s off: %s", transfer, address, exc)
            except KvxferdError:
                pass  # FAILED is terminal: nothing more lands
        try:
            transfer.release()
        except KvxferdError as exc:
            log.warning("could not release %r: %s", transfer, exc)

    async def close(self) -> None:
        """Stop polling and the post threads (pulls were cancelled and settled before)."""
        await self.poller.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
