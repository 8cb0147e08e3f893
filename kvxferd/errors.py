"""The one exception tree of kvxferd.

Everything kvxferd raises on purpose derives from :class:`KvxferdError`. Foreign errors (NIXL,
httpx, msgspec) are translated at the module that talks to them, ``raise ... from exc``.

    KvxferdError
    ├── ConfigError                 a flag, env var or config file is wrong
    ├── ManifestError               a manifest is inconsistent (names the field)
    │   └── UnsupportedModelError   the planner cannot lay out this HF config
    ├── BlockIdError                block ids out of range or for the wrong group (names the field)
    ├── MemoryRegionError           a region cannot be created, mapped or sized
    ├── TransportError              a NIXL call failed
    │   ├── RegistrationError       registering or deregistering memory failed
    │   ├── PeerDisconnectedError   the remote agent went away mid-transfer
    │   ├── TransferFailedError     a posted transfer ended in error
    │   ├── TransferTimeoutError    a transfer did not finish before its deadline
    │   ├── UnsettledReadError      a READ could not be confirmed stopped (pull reason unsettled)
    │   ├── TransportLookupError    NIXL found no such remote agent, registration or prepped list
    │   └── DescriptorError         descriptor lists or indices rejected (shape, length, range)
    ├── HandshakeError              a peer could not be reached or answered nonsense
    │   ├── IncompatiblePeerError   the peer's manifest disagrees (lists the fields)
    │   └── ClaimTimeoutError       a claim got no answer in time (pull reason claim_timeout)
    ├── HoldError                   hold/ticket problems on the prefill side
    │   ├── UnknownHoldError        no such hold (never existed, or already released)
    │   ├── HoldExpiredError        the hold's lease ran out; its blocks may be reused
    │   └── HoldRequestError        a hold/claim/heartbeat argument is invalid (names the field)
    │       └── DuplicateHoldError  the request id already has a live hold
    ├── AuthError                   a peer presented a wrong or missing token
    ├── NotRegisteredError          no engine has registered with this sidecar yet (HTTP 503)
    ├── AlreadyRegisteredError      this sidecar already has an engine (HTTP 409)
    ├── UnknownPullError            no pull with that id on this sidecar (HTTP 404)
    ├── PullError                   a pull did not move every byte it promised (has a reason)
    ├── StateError                  a pull/hold state moved backward or out of a terminal state
    ├── InvalidRequestError         an OpenAI-style HTTP request is invalid (names the field)
    │   └── UnknownModelError       the request names a model this server does not serve
    ├── PoolExhaustedError          a (simulated) engine has too few free KV blocks right now
    └── StartupError                a child process (sidecar, sim) did not become ready
"""

from __future__ import annotations


class KvxferdError(Exception):
    """Base of every error kvxferd raises on purpose."""


class ConfigError(KvxferdError):
    """A flag, environment variable or config file value is wrong."""


class ManifestError(KvxferdError):
    """A manifest (or planner input) is inconsistent; ``field`` names the offending path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UnsupportedModelError(ManifestError):
    """The planner does not know how to lay out this model configuration."""


class BlockIdError(KvxferdError):
    """Block ids that are out of range, duplicated, or given for the wrong group."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class MemoryRegionError(KvxferdError):
    """A memory region cannot be created, mapped or has the wrong size."""


class TransportError(KvxferdError):
    """A NIXL operation failed."""


class RegistrationError(TransportError):
    """Registering or deregistering memory with NIXL failed."""


class PeerDisconnectedError(TransportError):
    """The remote agent disconnected (or was never reachable) during a transfer."""


class TransferFailedError(TransportError):
    """A posted transfer finished in an error state."""


class TransferTimeoutError(TransportError):
    """A transfer did not complete before its deadline."""


class UnsettledReadError(TransportError):
    """A READ stayed in flight past its settle bound: its destination may still change."""

    code = "unsettled"  # read by the class-attribute reason table once errors carry codes


class TransportLookupError(TransportError):
    """NIXL found no such remote agent, registration covering the descriptors, or prepped list."""


class DescriptorError(TransportError):
    """Descriptor lists or indices were rejected: bad shape, length mismatch or out of range."""


class HandshakeError(KvxferdError):
    """A peer could not be reached for a handshake, or answered something unusable."""


class IncompatiblePeerError(HandshakeError):
    """Two manifests cannot exchange blocks; ``fields`` lists every disagreement."""

    def __init__(self, fields: dict[str, tuple[object, object]]) -> None:
        detail = "; ".join(f"{k}: local={a!r} remote={b!r}" for k, b, a in _triples(fields))
        super().__init__(f"incompatible peer: {detail}")
        self.fields = fields


def _triples(fields: dict[str, tuple[object, object]]) -> list[tuple[str, object, object]]:
    return [(k, remote, local) for k, (local, remote) in fields.items()]


class ClaimTimeoutError(HandshakeError):
    """A claim at a prefill sidecar got no answer in time (the pull reason ``claim_timeout``)."""

    code = "claim_timeout"  # read by the class-attribute reason table once errors carry codes


class HoldError(KvxferdError):
    """A hold (prefill-side pin of blocks) problem."""


class UnknownHoldError(HoldError):
    """No hold with that id exists (it never did, or it was already released)."""


class HoldExpiredError(HoldError):
    """The hold's lease ran out; its blocks may already be reused."""


class HoldRequestError(HoldError):
    """A hold, claim or heartbeat argument is invalid; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class DuplicateHoldError(HoldRequestError):
    """The request id already has a live hold (``field`` is ``request_id``)."""


class AuthError(KvxferdError):
    """A peer presented a missing or wrong bearer token."""


class NotRegisteredError(KvxferdError):
    """The call needs a registered engine and none has registered with this sidecar yet."""


class AlreadyRegisteredError(KvxferdError):
    """The sidecar already has an engine; a new layout needs a new sidecar (restart it)."""


class UnknownPullError(KvxferdError):
    """No pull with that id: never started here, or finished so long ago it was forgotten."""


class PullError(KvxferdError):
    """A pull failed; ``reason`` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class StateError(KvxferdError):
    """A state machine was asked to move backward or out of a terminal state (a bug)."""

    def __init__(self, current: object, new: object, reason: str) -> None:
        super().__init__(f"{current!r} -> {new!r}: {reason}")
        self.current = current
        self.new = new
        self.reason = reason


class InvalidRequestError(KvxferdError):
    """An OpenAI-style request (completion, chat) is invalid; ``field`` names the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UnknownModelError(InvalidRequestError):
    """The request's ``model`` is not the one this server serves (HTTP 404)."""


class PoolExhaustedError(KvxferdError):
    """Too few free KV blocks for a request right now (HTTP 503; a retry may succeed)."""


class StartupError(KvxferdError):
    """A child process (sidecar, simulated engine) exited or timed out before its ready line."""
