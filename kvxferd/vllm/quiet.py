"""The worker's sidecar client, left alone for a while after a call got no answer.

A hung sidecar (stopped, its event loop blocked) still accepts connections on its Unix socket,
so every call waits for the client's timeout (30 s), and a worker makes several calls each step
(the feeds, each hold and pull): every engine step, local requests' included, took that long.
After a call that got no answer, calls are refused at once (:class:`SidecarQuietError`, before
anything is sent: a hold refused so was never placed) for ten times as long as that call took,
at least a second, as the scheduler does with identities.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from kvxferd.client import EngineClient, SidecarError, SidecarUnreachableError
from kvxferd.errors import KvxferdError
from kvxferd.frameconn import FrameConnectError

QUIET_S = 1.0
"""Shortest time calls are refused after one got no answer..."""
QUIET_RATIO = 10.0
"""...and at least this many times as long as that call took."""
_NOT_SENT = (httpx.ConnectError, FrameConnectError, FileNotFoundError, ConnectionRefusedError)
"""Causes of an unreachable sidecar that mean the call never left: no connection was opened."""
_ALWAYS = frozenset({"close", "identity", "register", "unregister"})
"""Calls made whatever the sidecar did before: closing, and registration's (start, sleep and
wake-up, recovery: not made every step, and a wake-up must not fail for a past silence)."""


class SidecarQuietError(KvxferdError):
    """Not sent: a call to this sidecar got no answer a moment ago (nothing was asked of it)."""

    status = 503


class QuietClient:
    """An EngineClient whose calls are refused for a while after one got no answer."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._until = 0.0  # monotonic time before which calls are refused

    @property
    def quiet(self) -> bool:
        """Whether calls are refused now."""
        return time.monotonic() < self._until

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if name in _ALWAYS or name.startswith("_") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            if start < self._until:
                raise SidecarQuietError(
                    f"{name}: not sent, the sidecar did not answer a call "
                    f"{start - self._until + self._span:.1f} s ago"
                )
            try:
                return attr(*args, **kwargs)
            except SidecarUnreachableError:
                now = time.monotonic()
                self._span = max(QUIET_S, QUIET_RATIO * (now - start))
                self._until = now + self._span
                raise

        return call

    _span = 0.0  # how long calls are refused after the last that got no answer


def placed_maybe(exc: KvxferdError) -> bool:
    """Whether the hold or pull whose call raised ``exc`` may have been placed (or started) all
    the same: no answer came (timed out, the connection lost), or one that is not a refusal
    (unreadable, a server error). Not when no connection could be opened: nothing was sent."""
    if not isinstance(exc, SidecarError):
        return False  # one of the sidecar's own errors: refused before anything was placed
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, _NOT_SENT):
            return False
        cause = cause.__cause__
    return exc.status is None or not 400 <= exc.status < 500


def no_answer(exc: KvxferdError) -> bool:
    """Whether a call that raised ``exc`` got no answer, or one saying to try again (a 5xx the
    sidecar sent): not a refusal, nor a call that could not connect (no sidecar there)."""
    status = exc.status if getattr(exc, "body", None) is not None else None  # not raised here
    return placed_maybe(exc) or (isinstance(status, int) and status >= 500)
