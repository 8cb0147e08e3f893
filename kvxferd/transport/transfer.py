"""One posted NIXL READ: poll it, wait for it with a deadline, read its telemetry, release it.

State only moves forward (POSTED -> DONE or POSTED -> FAILED) and a failure is sticky, so a
transfer can never be seen as DONE after it failed.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvxferd.errors import (
    KvxferdError,
    TransferFailedError,
    TransferTimeoutError,
    TransportError,
)
from kvxferd.transport.handle import ReleasedOnExit
from kvxferd.transport.nixl_errors import nixl_errors

logger = logging.getLogger(__name__)

SPIN_S = 0.005
"""How long :meth:`Transfer.wait` busy-polls (yielding the GIL) before it starts to back off."""
MAX_BACKOFF_S = 0.0005
"""Longest sleep between polls once backing off."""


class TransferState(enum.IntEnum):
    """Where a transfer is; only ever increases."""

    POSTED = 1
    DONE = 2
    FAILED = 3


class Transfer(ReleasedOnExit):
    """A posted READ owned by the caller; release it on every path (it is a context manager)."""

    def __init__(
        self,
        nx: Any,
        handle: Any,
        *,
        remote: str,
        nbytes: int,
        descriptors: int,
        capture_telemetry: bool,
        on_release: Callable[[Transfer], None],
    ) -> None:
        self._nx = nx
        self._handle = handle
        self.remote = remote
        """Name of the agent read from."""
        self.nbytes = nbytes
        """Bytes requested."""
        self.descriptors = descriptors
        """Descriptors requested (before NIXL merges any)."""
        self._capture = capture_telemetry
        self._on_release = on_release
        self._lock = threading.Lock()
        self._state = TransferState.POSTED
        self._error: KvxferdError | None = None
        self._released = False
        self._posted_at = 0.0
        self._done_at: float | None = None
        self._telemetry: dict[str, float | int] | None = None

    def _subject(self) -> str:
        return f"READ {self.nbytes} B in {self.descriptors} descs from {self.remote!r}"

    def _post(self) -> None:
        """Post the request (called once by the agent right after creating it)."""
        self._posted_at = time.monotonic()
        with nixl_errors("post", self._subject(), default=TransferFailedError):
            status = self._nx.transfer(self._handle)
        if status == "DONE":
            self._mark_done()
        elif status != "PROC":
            raise TransferFailedError(f"post ({self._subject()}): NIXL returned {status}")

    @property
    def state(self) -> TransferState:
        """Last known state (does not ask NIXL; see :meth:`poll`)."""
        return self._state

    @property
    def error(self) -> KvxferdError | None:
        """Why the transfer failed, once it has."""
        return self._error

    @property
    def released(self) -> bool:
        """Whether the NIXL handle was released."""
        return self._released

    def poll(self) -> TransferState:
        """Ask NIXL once; never raises for a failed transfer (see :attr:`error`)."""
        with self._lock:
            if self._state is not TransferState.POSTED:
                return self._state
            try:
                with nixl_errors("check", self._subject(), default=TransferFailedError):
                    status = self._nx.check_xfer_state(self._handle)
            except TransportError as exc:
                self._fail(exc)
                return self._state
            if status == "DONE":
                self._mark_done()
            elif status != "PROC":
                self._fail(TransferFailedError(f"check ({self._subject()}): NIXL said {status}"))
            return self._state

    def wait(self, timeout_s: float) -> TransferState:
        """Poll until DONE (returned), FAILED (its error raised) or ``timeout_s`` elapsed."""
        return self.wait_until(time.monotonic() + timeout_s)

    def wait_until(self, deadline: float) -> TransferState:
        """Like :meth:`wait` with an absolute ``time.monotonic()`` deadline.

        Busy-polls first (a READ of a few MiB takes about a millisecond), then backs off to
        short sleeps so a slow transfer does not burn a core. Raises TransferTimeoutError;
        the transfer stays POSTED and must still be released.
        """
        start = time.monotonic()
        backoff = 1e-5
        while True:
            state = self.poll()
            if state is TransferState.DONE:
                return state
            if state is TransferState.FAILED:
                assert self._error is not None
                raise self._error
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeoutError(
                    f"{self._subject()} not done after {now - start:.3f} s (deadline passed)"
                )
            if now - start < SPIN_S:
                time.sleep(0)
            else:
                time.sleep(min(backoff, MAX_BACKOFF_S, max(deadline - now, 0.0)))
                backoff *= 2

    def telemetry(self) -> dict[str, float | int] | None:
        """NIXL's numbers for a DONE transfer (None if not done or telemetry is off).

        Keys: ``bytes``, ``descriptors`` (after NIXL's merging), ``post_s``, ``transfer_s``,
        and ``wall_s`` (post to first poll that saw DONE, measured here).
        """
        return None if self._telemetry is None else dict(self._telemetry)

    def release(self) -> None:
        """Free the NIXL handle (cancelling if still in flight). Idempotent.

        If NIXL refuses (cannot cancel), raises and the transfer stays counted as live.
        """
        with self._lock:
            if self._released:
                return
            with nixl_errors("release", self._subject()):
                self._handle.release()
            self._released = True
            if self._state is TransferState.POSTED:
                self._fail(TransferFailedError(f"{self._subject()}: released before completion"))
        self._on_release(self)

    def _mark_done(self) -> None:
        self._done_at = time.monotonic()
        self._state = TransferState.DONE
        self._telemetry = {"wall_s": self._done_at - self._posted_at}
        if self._capture:
            self._telemetry.update(self._nixl_telemetry())

    def _nixl_telemetry(self) -> dict[str, float | int]:
        try:
            t = self._nx.get_xfer_telemetry(self._handle)
        except Exception as exc:  # telemetry is best effort; nixlNoTelemetryError and kin
            logger.debug("no telemetry for %s: %s", self._subject(), exc)
            return {}
        return {
            "bytes": int(t.totalBytes),
            "descriptors": int(t.descCount),
            "post_s": t.postDuration / 1e6,
            "transfer_s": t.xferDuration / 1e6,
        }

    def _fail(self, exc: KvxferdError) -> None:
        if self._state is TransferState.POSTED:
            self._state = TransferState.FAILED
            self._error = exc

    def __repr__(self) -> str:
        return f"Transfer({self._subject()}, {self._state.name}, released={self._released})"
