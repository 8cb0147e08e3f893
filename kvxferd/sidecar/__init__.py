"""The sidecar service: holds with leases, tickets, pulls, peers, and their state machines."""

from kvxferd.sidecar.holds import (
    ClaimGrant,
    Hold,
    HoldCounters,
    HoldTable,
    NotifyOutcome,
    check_block_ids,
)
from kvxferd.sidecar.states import HoldState, PullState, advance
from kvxferd.sidecar.tickets import sign_ticket, ticket_mac, verify_ticket

__all__ = [
    "ClaimGrant",
    "Hold",
    "HoldCounters",
    "HoldState",
    "HoldTable",
    "NotifyOutcome",
    "PullState",
    "advance",
    "check_block_ids",
    "sign_ticket",
    "ticket_mac",
    "verify_ticket",
]
