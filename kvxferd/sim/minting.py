"""Tickets a prefill sim mints itself, as the vLLM connector's scheduler does: the request is
answered at once and its holds are placed after it (a claim that comes first waits for its hold,
kvxferd.sidecar.placements), which takes a hold call off the P/D critical path.

Minting needs the sidecars' own peer secret, else every claim of a minted ticket is refused. So
the sim first holds and answers with the tickets the sidecars signed, checks that its secret
signs them the same, reads each rank's identity once, and only then mints; after any placement
fails it holds first again until it has learnt anew.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence

import httpx

from kvxferd.client import AsyncEngineClient
from kvxferd.errors import AuthError, KvxferdError
from kvxferd.sidecar.tickets import mint_tickets, verify_tickets
from kvxferd.wire import Identity, Ticket

log = logging.getLogger(__name__)


class Minter:
    """Mints a prefill request's tickets (one per rank) once it knows it may."""

    def __init__(
        self, clients: Sequence[AsyncEngineClient], secret: bytes | None, lease_s: float | None
    ) -> None:
        self._clients = list(clients)
        self._secret = secret or None  # None: never mint (the secret is unknown or not theirs)
        self._lease_s = lease_s
        self._idents: list[Identity] | None = None  # None: hold first, then learn

    @property
    def ready(self) -> bool:
        """Whether the next request's tickets are minted here."""
        return self._idents is not None

    def mint(self, request_id: str, block_ids: list[list[int]], num_tokens: int) -> list[Ticket]:
        """Tickets naming one new hold id on every rank (call only when ``ready``)."""
        assert self._idents is not None and self._secret is not None
        return mint_tickets(self._idents, self._secret, hold_id=secrets.token_hex(16),
                            request_id=request_id, block_ids=block_ids, num_tokens=num_tokens,
                            lease_s=self._lease_s)  # fmt: skip

    async def learn(self, signed: list[Ticket]) -> None:
        """After the sidecars held a request and signed its tickets: mint from now on if our
        secret signs as theirs do and every rank still names the ticket's epoch and
        registration generation."""
        if self._secret is None or self._idents is not None:
            return
        try:
            verify_tickets(signed, self._secret)
        except AuthError:
            log.warning("the sidecars sign tickets with another secret than KVXFERD_PEER_TOKEN "
                        "here: holds are placed before each prefill answers")  # fmt: skip
            self._secret = None
            return
        try:
            idents = await asyncio.gather(*(c.identity() for c in self._clients))
        except (KvxferdError, httpx.HTTPError) as exc:
            log.info("sidecar identities unavailable, holding first for now: %s", exc)
            return
        names = [(i.epoch, i.generation, i.tp_rank) for i in idents]
        if names == [(t.epoch, t.generation, t.tp_rank) for t in signed]:
            self._idents = list(idents)

    def forget(self) -> None:
        """A minted hold was not placed (a sidecar restarted, re-registered, refused it): hold
        first again until the next ``learn``."""
        self._idents = None
