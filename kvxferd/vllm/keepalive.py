"""Keepalives off the engine's step: a worker hands a step's tickets over and goes on.

The decode sidecar answers a keepalive only once every prefill sidecar named has answered or
timed out (the peer timeout, seconds), and vLLM's step waits for its workers: sent from the step,
a prefill pod that stopped answering would stall every step that keeps one of its holds alive.
One thread sends them instead, through its own connection to the sidecar; tickets handed over
while it is busy wait for its next round (at most ``MAX_PENDING``; beyond that they wait for
their next keepalive).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvxferd.client import EngineClient
from kvxferd.errors import KvxferdError
from kvxferd.wire import MAX_TICKETS_PER_CALL, Ticket

log = logging.getLogger(__name__)

MAX_PENDING = 4 * MAX_TICKETS_PER_CALL
"""Tickets waiting for the sender at most."""
CLOSE_WAIT_S = 1.0
"""How long closing waits for a round in flight (the thread is a daemon: it ends with vLLM)."""


class KeepaliveSender:
    """Sends keepalives for ``tickets`` handed to :meth:`send`, in its own thread (started on
    first use), ``extend_s`` each, MAX_TICKETS_PER_CALL tickets a call."""

    def __init__(self, connect: Callable[[], EngineClient], extend_s: float) -> None:
        self._connect = connect
        self._extend_s = extend_s
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def send(self, tickets: list[dict[str, Any]]) -> None:
        """Queue ``tickets`` for the next round; returns at once."""
        if not tickets or self._closed:
            return
        with self._lock:
            room = MAX_PENDING - len(self._pending)
            if room < len(tickets):
                log.warning("keepalive: %d tickets not queued (sender busy)", len(tickets) - room)
            self._pending.extend(tickets[: max(0, room)])
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvxferd-keepalive", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        client = self._connect()
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                with self._lock:
                    batch, self._pending = self._pending, []
                if self._closed:
                    return
                self._round(client, batch)
        finally:
            client.close()

    def _round(self, client: EngineClient, tickets: list[dict[str, Any]]) -> None:
        """One call per MAX_TICKETS_PER_CALL tickets; a failure is logged (those holds keep the
        lease they have, and their next keepalive is due soon)."""
        for at in range(0, len(tickets), MAX_TICKETS_PER_CALL):
            part = [Ticket(**t) for t in tickets[at : at + MAX_TICKETS_PER_CALL]]
            try:
                answer = client.keepalive(part, self._extend_s)
            except KvxferdError as exc:
                log.warning("keepalive of %d tickets failed: %s", len(part), exc)
                continue
            except Exception:  # this thread must outlive any one call
                log.exception("keepalive of %d tickets failed", len(part))
                continue
            if answer.missing or answer.unanswered:
                log.info("keepalive: %d holds gone, %d unanswered", len(answer.missing),
                         len(answer.unanswered))  # fmt: skip

    def close(self) -> None:
        """Stop the thread (after the round in flight, waiting at most CLOSE_WAIT_S for it)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
