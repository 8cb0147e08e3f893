"""A descriptor list prepared once in NIXL so later READs address it by index.

Local lists describe this agent's registered memory; remote lists a peer's, and become stale
when that peer is removed or re-added (the agent then releases them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxferd.errors import TransportLookupError
from kvxferd.transport.handle import ReleasedOnExit
from kvxferd.transport.nixl_errors import nixl_errors


class PreppedList(ReleasedOnExit):
    """Handle to a prepped descriptor list of :attr:`count` entries; release it when done."""

    def __init__(
        self,
        handle: Any,
        *,
        remote: str | None,
        lens: np.ndarray,
        mem: str,
        on_release: Callable[[PreppedList], None],
    ) -> None:
        self._handle = handle
        self.remote = remote
        """Remote agent name, or None for a local list."""
        self.lens = lens
        """Length in bytes of each descriptor (uint64, read-only)."""
        self.count = int(lens.shape[0])
        """Number of descriptors (valid indices are ``0..count-1``)."""
        self.mem = mem
        """NIXL memory type of the descriptors."""
        self._on_release = on_release
        self._lock = threading.Lock()
        self._released = False

    @property
    def released(self) -> bool:
        """Whether the NIXL handle was released."""
        return self._released

    @property
    def is_local(self) -> bool:
        """True for a list describing this agent's memory."""
        return self.remote is None

    def nixl_handle(self) -> Any:
        """The live NIXL handle; TransportLookupError if released."""
        if self._released:
            raise TransportLookupError(
                f"prepped list ({self._describe()}) was released"
                + ("" if self.remote is None else "; re-prep it after the peer was re-added")
            )
        return self._handle

    def release(self) -> None:
        """Free the NIXL handle. Idempotent."""
        with self._lock:
            if self._released:
                return
            with nixl_errors("release prepped list", self._describe()):
                self._handle.release()
            self._released = True
        self._on_release(self)

    def _describe(self) -> str:
        side = "local" if self.remote is None else f"remote {self.remote!r}"
        return f"{side}, {self.count} descs, {self.mem}"

    def __repr__(self) -> str:
        return f"PreppedList({self._describe()}, released={self._released})"
