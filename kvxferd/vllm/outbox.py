"""Declines and keepalives off the engine's step: a worker hands a step's over and goes on.

The decode sidecar answers a decline or a keepalive only once every prefill sidecar it names has
answered or timed out (the peer timeout, seconds), and vLLM's step waits for its workers: sent
from the step, a prefill pod that stopped answering would stall the step that declines or keeps
one of its holds alive. One thread sends them instead, through its own connection to the
sidecar; what is handed over while it is busy waits for its next round, declines first (at most
``MAX_PENDING`` tickets of each kind; a decline dropped beyond that leaves its hold to end with
its lease, a keepalive waits for its next one). A sender that cannot open its connection tries
CONNECT_TRIES times, then ends; the next hand-over starts another (what waits stays queued).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvxferd.client import EngineClient
from kvxferd.errors import KvxferdError
from kvxferd.vllm.scheduler import Decline
from kvxferd.wire import MAX_TICKETS_PER_CALL, Ticket

log = logging.getLogger(__name__)

MAX_PENDING = 4 * MAX_TICKETS_PER_CALL
"""Tickets of each kind (declines, keepalives) waiting for the sender at most."""
CONNECT_TRIES = 5
"""Tries a sender makes to open its connection (each failure logged) before it ends; the next
hand-over starts a new one, and what was queued waits for it."""
CONNECT_BACKOFF_S = 0.1
"""The wait after a sender's first failed try, doubled after each (1.5 s over all its tries)."""
CLOSE_WAIT_S = 1.0
"""How long closing waits for the round in flight and what is queued (the thread is a daemon: it
ends with vLLM)."""


class Outbox:
    """Sends the declines and keepalives handed to it in its own thread (started on first use),
    MAX_TICKETS_PER_CALL tickets a call: declines with their reason, keepalives ``extend_s``."""

    def __init__(self, connect: Callable[[], EngineClient], extend_s: float) -> None:
        self._connect = connect
        self._extend_s = extend_s
        self._declines: dict[str, list[dict[str, Any]]] = {}  # reason -> tickets
        self._keepalives: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._stop = threading.Event()  # set by close: a sender waiting to try again ends
        self._thread: threading.Thread | None = None  # None: no sender (or it gave up)

    def decline(self, declines: list[Decline]) -> None:
        """Queue a step's declines for the next round; returns at once."""
        if not declines or self._closed:
            return
        with self._lock:
            dropped = 0
            room = MAX_PENDING - sum(map(len, self._declines.values()))  # a few reasons
            for d in declines:
                queued = d.tickets[: max(0, room)]
                if queued:
                    self._declines.setdefault(d.reason, []).extend(queued)
                room -= len(queued)
                dropped += len(d.tickets) - len(queued)
            if dropped:
                log.warning("decline: %d tickets not queued (sender busy); their holds end with "
                            "their lease", dropped)  # fmt: skip
            self._start()
        self._wake.set()

    def keepalive(self, tickets: list[dict[str, Any]]) -> None:
        """Queue a keepalive of ``tickets`` for the next round; returns at once."""
        if not tickets or self._closed:
            return
        with self._lock:
            room = max(0, MAX_PENDING - len(self._keepalives))
            if room < len(tickets):
                log.warning("keepalive: %d tickets not queued (sender busy)", len(tickets) - room)
            self._keepalives.extend(tickets[:room])
            self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvxferd-outbox", daemon=True)
            self._thread.start()

    def _take(self) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
        with self._lock:
            declines, self._declines = self._declines, {}
            keepalives, self._keepalives = self._keepalives, []
        return declines, keepalives

    def _open(self) -> EngineClient | None:
        """The sender's connection, after at most CONNECT_TRIES tries with a growing wait
        between; None when they all failed (the sender is let go: the next hand-over starts a
        new one) or the outbox closed meanwhile."""
        for attempt in range(CONNECT_TRIES):
            try:
                return self._connect()
            except Exception as exc:  # a failure of the call we make, whatever its kind
                log.warning("outbox: connecting to the sidecar failed (try %d of %d): %s",
                            attempt + 1, CONNECT_TRIES, exc)  # fmt: skip
            if attempt + 1 < CONNECT_TRIES and self._stop.wait(CONNECT_BACKOFF_S * 2**attempt):
                return None
        log.error("outbox: gave up connecting after %d tries; declines and keepalives wait "
                  "for the next hand-over's sender", CONNECT_TRIES)  # fmt: skip
        with self._lock:
            self._thread = None
        return None

    def _run(self) -> None:
        client = self._open()
        if client is None:
            return
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                declines, keepalives = self._take()
                for reason, tickets in declines.items():  # first: they free memory now
                    self._round(client, tickets, reason)
                if self._closed:
                    return  # (keepalives need not outlive the engine)
                self._round(client, keepalives, None)
        finally:
            client.close()

    def _round(
        self, client: EngineClient, tickets: list[dict[str, Any]], reason: str | None
    ) -> None:
        """One call per MAX_TICKETS_PER_CALL tickets; a failure is logged (declined holds end
        with their lease, kept ones keep the lease they have and their next keepalive is due
        soon)."""
        what = "keepalive" if reason is None else "decline"
        for at in range(0, len(tickets), MAX_TICKETS_PER_CALL):
            part = [Ticket(**t) for t in tickets[at : at + MAX_TICKETS_PER_CALL]]
            try:
                if reason is None:
                    answer = client.keepalive(part, self._extend_s)
                    gone, unanswered = answer.missing, answer.unanswered
                else:
                    answer = client.decline(part, reason)
                    gone, unanswered = answer.busy, answer.unanswered
            except KvxferdError as exc:
                log.warning("%s of %d tickets failed: %s", what, len(part), exc)
                continue
            except Exception:  # this thread must outlive any one call
                log.exception("%s of %d tickets failed", what, len(part))
                continue
            if gone or unanswered:
                log.info("%s: %d holds %s, %d unanswered", what, len(gone),
                         "gone" if reason is None else "busy", len(unanswered))  # fmt: skip

    def close(self) -> None:
        """Send what is queued of the declines and stop the thread (waiting at most
        CLOSE_WAIT_S for it)."""
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
