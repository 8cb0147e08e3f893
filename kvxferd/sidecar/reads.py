"""READs that fail closed: once ``Reads.read`` returns or raises, nothing it posted can write.

A posted READ is never abandoned. Cancelling the caller (a pull's deadline, shutdown) while a
READ is being posted or is in flight does not end ``read`` early: the post finishes, the
transfer is driven to a terminal state, and only then is its handle released and the
cancellation passed on. Why not just release it: NIXL 1.5.1 releases an in-flight handle by
``ucp_request_cancel`` + free, which UCX does not honour for RMA gets; removing the remote agent
does not stop them either (both measured over UCX TCP: the bytes land once the peer
progresses, tests/transport/test_release_in_flight.py). Neither is proof that nothing will be
written.

The bound: a READ gets ``SETTLE_S`` past the end of its wait to reach DONE or FAILED on its
own. One that does not (its peer is frozen and the READ needs the peer to progress) cannot be
confirmed stopped: ``read`` raises UnsettledReadError (pull reason ``unsettled``: the
destination blocks may still change and must not be reused while the sidecar reports live
NIXL handles), and the transfer is quarantined -- kept, polled slowly until it ends on its own
(the peer resumes, or UCX declares it dead), then released and reported to ``on_ended`` (its
destination can be reused). After ``QUARANTINE_S`` it is given up: the peer is forgotten and the
handle released, logged as an error, and ``on_ended`` is never called (its bytes may still
land). On the loopback/CMA path the bytes are copied inside the post itself (process_vm_readv),
so what can stay in flight there is the completion notification, not data; over RDMA the NIC
serves a frozen process.

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

from kvxferd.errors import KvxferdError, TransferTimeoutError, UnsettledReadError
from kvxferd.transport import TransferState
from kvxferd.transport.base import PostedRead, Transport
from kvxferd.transport.completion import CompletionPoller

log = logging.getLogger(__name__)
T = TypeVar("T")

SETTLE_S = 2.0
"""Seconds a READ may take past the end of its wait to reach DONE/FAILED (else: unsettled)."""
QUARANTINE_S = 300.0
"""Seconds an unsettled READ is kept and polled before it is given up (peer forgotten)."""
QUARANTINE_POLL_S = 0.1
"""Poll interval of quarantined READs."""
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


def _release(transfer: PostedRead) -> None:
    try:
        transfer.release()
    except KvxferdError as exc:
        log.warning("could not release %r: %s", transfer, exc)


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
        self._quarantine: set[asyncio.Task[None]] = set()
        self.unsettled = 0
        """READs that did not settle within SETTLE_S (quarantined)."""

    @property
    def quarantined(self) -> int:
        """READs quarantined now: each may still write its destination (which must stay mapped)."""
        return len(self._quarantine)

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

    @staticmethod
    def inline(nbytes: int, descs: int) -> bool:
        """Whether a READ of this size is posted on the loop (else on the post threads)."""
        return nbytes <= INLINE_BYTES and descs <= INLINE_DESCS

    def _post(
        self, post: Callable[[], PostedRead], nbytes: int, descs: int
    ) -> asyncio.Future[PostedRead]:
        loop = asyncio.get_running_loop()
        if self.inline(nbytes, descs):
            fut: asyncio.Future[PostedRead] = loop.create_future()
            try:
                fut.set_result(post())
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                fut.set_exception(exc)
            return fut
        if self._executor is None:
            self._executor = ThreadPoolExecutor(POST_THREADS, thread_name_prefix="kvxferd-post")
        return loop.run_in_executor(self._executor, post)

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
        on_unsettled: Callable[[str], None] | None = None,
        on_ended: Callable[[], None] | None = None,
        post: Callable[[], PostedRead] | None = None,
    ) -> PostedRead:
        """Post a READ from agent ``remote`` (at ``address``) and wait for it until ``deadline``
        (``time.monotonic()``). Returns the DONE transfer, released; raises otherwise, but
        only once the READ can no longer write (see the module docstring). A READ that stays
        in flight is quarantined and reported to ``on_unsettled`` (even when the caller was
        cancelled meanwhile), then UnsettledReadError is raised; ``on_ended`` is called once it
        ends on its own (DONE or FAILED: it can no longer write). ``post`` replaces the plain
        READ of the descriptor tables (a prepped READ by index; the tables are then unused)."""
        if post is None:
            post = functools.partial(self._agent.read, remote, local_descs, remote_descs, notif)
        async with self._slot(address):
            posting = self._post(post, nbytes, descs)
            transfer: PostedRead | None = None
            try:
                transfer = await run_to_end(posting)
                await self.poller.wait(transfer, deadline)
                return transfer
            finally:
                if transfer is None and _posted(posting):
                    transfer = posting.result()
                if transfer is not None and transfer.state is not TransferState.POSTED:
                    _release(transfer)  # DONE or FAILED: it can no longer write
                elif transfer is not None:
                    settle = self._settle(transfer, address, on_unsettled, on_ended)
                    why = await run_to_end(settle)
                    if why:
                        raise UnsettledReadError(why)

    async def _settle(
        self,
        transfer: PostedRead,
        address: str,
        on_unsettled: Callable[[str], None] | None,
        on_ended: Callable[[], None] | None = None,
    ) -> str:
        """Bring ``transfer`` to a terminal state (bounded) and release it; if it stayed in
        flight, quarantine it instead and return why (reported to ``on_unsettled`` too)."""
        if transfer.state is TransferState.POSTED:
            try:
                await self.poller.wait(transfer, time.monotonic() + SETTLE_S)
            except TransferTimeoutError:
                why = (f"{transfer!r} still in flight {SETTLE_S:g} s after its wait ended: "
                       "its destination blocks may still change")  # fmt: skip
                self._quarantined(transfer, address, on_ended)
                if on_unsettled is not None:
                    on_unsettled(why)
                return why
            except KvxferdError:
                pass  # the transport failed it: terminal
        _release(transfer)
        return ""

    def _quarantined(
        self, transfer: PostedRead, address: str, on_ended: Callable[[], None] | None
    ) -> None:
        self.unsettled += 1
        log.warning("%r unsettled: quarantined until it ends (at most %g s)", transfer,
                    QUARANTINE_S)  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._keep(transfer, address, on_ended))
        self._quarantine.add(task)
        task.add_done_callback(self._quarantine.discard)

    async def _keep(
        self, transfer: PostedRead, address: str, on_ended: Callable[[], None] | None
    ) -> None:
        """Poll a quarantined READ slowly until it ends (then ``on_ended``); give it up after
        QUARANTINE_S (``on_ended`` not called: it may still write)."""
        end = time.monotonic() + QUARANTINE_S
        ended = False
        try:
            while transfer.poll() is TransferState.POSTED:
                if time.monotonic() > end:
                    log.error("%r never ended: giving up %s (its bytes may still land)",
                              transfer, address)  # fmt: skip
                    await self._on_stuck(address)
                    break
                await asyncio.sleep(QUARANTINE_POLL_S)
            else:
                ended = True  # DONE or FAILED, seen here: it can no longer write
        finally:
            _release(transfer)
        if ended and on_ended is not None:
            on_ended()

    async def close(self) -> None:
        """Stop polling, quarantine and the post threads (pulls were cancelled before). Ending
        the quarantine releases READs that may still write: only once their memory is no longer
        needed (the sidecar's unregister refuses while ``quarantined``)."""
        for task in list(self._quarantine):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.poller.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
