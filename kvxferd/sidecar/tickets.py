"""Sign and verify Tickets with HMAC-SHA256 keyed by the shared peer secret.

A ticket travels through the engines and the proxy (untrusted hands) before a decode sidecar
presents it to the prefill sidecar; the MAC makes any edit of its block ids, expiry or peer
detectable. The MAC covers every field except ``token``, encoded canonically as the msgspec JSON
of the ticket with ``token=""`` (fields in declaration order, floats in shortest round-trip form,
so a JSON round trip re-encodes to the same bytes).

During a key rollover a ticket verifies under any accepted secret (see kvxferd.sidecar.signing):
a ticket minted with the previous secret stays valid while both are configured.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Sequence

import msgspec

from kvxferd.errors import AuthError, ClaimMismatchError, ConfigError, UnknownHoldError
from kvxferd.wire import Identity, Manifest, Ticket

_encoder = msgspec.json.Encoder()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ConfigError("peer secret: must be non-empty bytes")


def ticket_mac(ticket: Ticket, secret: bytes) -> str:
    """Hex HMAC-SHA256 of the ticket's canonical bytes (its ``token`` ignored)."""
    _check_secret(secret)
    canonical = _encoder.encode(msgspec.structs.replace(ticket, token=""))
    return hmac.new(bytes(secret), canonical, hashlib.sha256).hexdigest()


def sign_ticket(ticket: Ticket, secret: bytes) -> Ticket:
    """A copy of ``ticket`` whose ``token`` is its MAC."""
    return msgspec.structs.replace(ticket, token=ticket_mac(ticket, secret))


def mint_tickets(
    idents: Sequence[Identity], secret: bytes, *, hold_id: str, request_id: str,
    block_ids: list[list[int]], num_tokens: int, lease_s: float | None = None,
) -> list[Ticket]:  # fmt: skip
    """An engine's signed tickets (one per rank, rank order) for a hold it places itself with
    the chosen ``hold_id``: the request is answered without waiting for its sidecars. The
    expiry counts from now, so a ticket never outlives its hold (placed after)."""
    now = time.time()
    return [
        sign_ticket(
            Ticket(
                engine_id=ident.engine_id,
                epoch=ident.epoch,
                hold_id=hold_id,
                request_id=request_id,
                block_ids=block_ids,
                num_tokens=num_tokens,
                expires_at=now + (ident.default_lease_s if lease_s is None else lease_s),
                tp_rank=ident.tp_rank,
                tp_size=ident.tp_size,
                peer=ident.peer_address,
                generation=ident.generation,
                ranks=ident.pod_ranks,
            ),
            secret,
        )
        for ident in idents
    ]


def verify_ticket(ticket: Ticket, secret: bytes | Iterable[bytes]) -> None:
    """Raise AuthError unless ``ticket.token`` is the MAC of its other fields under ``secret``
    (or under one of several secrets: a key rollover)."""
    if not ticket.token:
        raise AuthError("ticket.token: missing")
    given = ticket.token.encode("utf-8", "replace")
    secrets = [secret] if isinstance(secret, bytes | bytearray) else list(secret)
    if not secrets:
        raise ConfigError("peer secret: no secret to verify with")
    ok = False
    for key in secrets:  # every key is tried: the time does not tell which one matched
        ok |= hmac.compare_digest(ticket_mac(ticket, key).encode("ascii"), given)
    if not ok:
        raise AuthError("ticket.token: does not match the ticket (tampered, or another secret)")


def verify_tickets(tickets: Iterable[Ticket], secret: bytes | Iterable[bytes]) -> None:
    """``verify_ticket`` of each; the AuthError names the first bad one (``tickets[i].token``)
    in its message and its ``field``."""
    keys = [secret] if isinstance(secret, bytes | bytearray) else list(secret)
    for i, ticket in enumerate(tickets):
        try:
            verify_ticket(ticket, keys)
        except AuthError as exc:
            err = AuthError(f"tickets[{i}].{str(exc).removeprefix('ticket.')}")
            err.field = f"tickets[{i}].token"  # type: ignore[attr-defined]
            raise err from None


def check_addressed(
    ticket: Ticket, engine_id: str, epoch: int, generation: int, manifest: Manifest,
    ranks: int = 1,
) -> None:  # fmt: skip
    """That a (verified) ticket names this sidecar as it is now: its engine and boot epoch, its
    registration generation (404 UnknownHoldError: the hold went with a restart, sleep/wake or
    re-init) and this rank's TP shape (409 ClaimMismatchError), the ranks a hold here spans
    included (``ranks``: a pod sidecar's ``--pod-ranks``, whose manifest is rank 0's)."""
    if (ticket.engine_id, ticket.epoch) != (engine_id, epoch):
        raise UnknownHoldError(
            f"ticket names engine {ticket.engine_id} epoch {ticket.epoch}; this sidecar is "
            f"{engine_id} epoch {epoch} (restarted?)"
        )
    if ticket.generation != generation:  # its hold went with that registration
        raise UnknownHoldError(
            f"ticket names registration generation {ticket.generation}; the engine "
            f"re-registered (sleep/wake?) and is at generation {generation}"
        )
    if ticket.ranks != ranks:
        raise ClaimMismatchError(
            "ticket.ranks", f"a hold over {ticket.ranks} ranks, but a hold here spans {ranks}"
        )
    if (ticket.tp_rank, ticket.tp_size) != (manifest.tp_rank, manifest.tp_size):
        raise ClaimMismatchError(
            "ticket.tp_rank", f"rank {ticket.tp_rank} of {ticket.tp_size}, but this sidecar "
            f"holds rank {manifest.tp_rank} of {manifest.tp_size}",
        )  # fmt: skip
