"""The sidecar service: holds with leases, tickets, pulls, peers, and their state machines."""

from kvxferd.sidecar.holds import (
    ClaimGrant,
    Hold,
    HoldCounters,
    HoldTable,
    NotifyOutcome,
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
    "sign_ticket",
    "ticket_mac",
    "verify_ticket",
]
