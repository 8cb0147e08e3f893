"""The one exception tree of kvxferd, and the one place that knows what each error means.

Everything kvxferd raises on purpose derives from :class:`KvxferdError`. Foreign errors (NIXL,
httpx, msgspec) are translated at the module that talks to them, ``raise ... from exc``.

Each class carries two class attributes, inherited unless overridden, from which every table is
derived (the API codec's statuses, the OpenAPI error documentation, the simulator's and the
client's mappings, the peer-answer translation and the pull failure reasons):

- ``status``: the HTTP status an API answers when a handler raises it;
- ``code``: the machine-readable reason code a pull that fails with it reports
  (``PullStatus.reason``, ``kvxferd_pull_failures_total{reason}``). Named ``code`` because
  several classes already carry an instance ``reason`` (the human explanation).

An empty cell (st. = status) is inherited from the parent class.

    class                          st.  code              meaning
    KvxferdError                   400  transfer          base of every error kvxferd raises
    ├── ConfigError                500                    a flag, env var or config file is wrong
    │   └── PathInUseError                                another running process holds its lock
    ├── ManifestError              422                    a manifest is inconsistent (names field)
    │   └── UnsupportedModelError                         the planner cannot lay out this config
    ├── BlockIdError               422  block_ids         bad block ids (names the field)
    ├── MemoryRegionError          422                    a region cannot be made, mapped, sized
    │   └── SegmentTooSmallError        segment_too_small a segment no longer backs its region
    ├── TransportError             502                    a NIXL call failed
    │   ├── RegistrationError                             (de)registering memory failed
    │   ├── PeerDisconnectedError       peer_disconnected remote agent gone mid-transfer
    │   ├── TransferFailedError                           a posted transfer ended in error
    │   ├── TransferTimeoutError        deadline          a transfer missed its deadline
    │   ├── UnsettledReadError          unsettled         a READ not confirmed stopped
    │   ├── TransportLookupError                          no such agent, registration, list
    │   └── DescriptorError                               descriptors or indices rejected
    ├── HandshakeError             502  handshake         peer unreachable or answered nonsense
    │   ├── IncompatiblePeerError  409  incompatible      manifests disagree (lists fields)
    │   └── ClaimTimeoutError           claim_timeout     a claim got no answer in time
    ├── HoldError                  502                    bare: a sidecar did not hold blocks
    │   ├── UnknownHoldError       404  unknown_hold      no such hold (or already released)
    │   ├── HoldExpiredError       410  hold_expired      lease ran out; blocks may be reused
    │   └── HoldRequestError       422                    a hold/claim argument is invalid
    │       └── DuplicateHoldError 409                    the request id has a live hold
    ├── AuthError                  401  auth              a wrong or missing token or signature
    │   ├── SignedBeforeStartError                        signed before this process may trust it
    │   └── ClaimMismatchError     409                    a signed ticket not binding to its hold
    ├── NotRegisteredError         503                    no engine has registered yet
    ├── AlreadyRegisteredError     409                    this sidecar already has an engine
    │   └── RegisterInProgressError                       another register is being set up (retry)
    ├── PodConflictError           409                    a pod rank disagrees with the pod (field)
    ├── StaleGenerationError       409                    not the current registration generation
    ├── CallExpiredError           408                    the engine gave the call up before it came
    ├── MemoryInUseError           503                    a READ or store copy may still use it
    ├── UnknownPullError           404                    no pull with that id here
    ├── PullError                  502  pull              a pull did not move every byte
    ├── StateError                 409                    a state moved backward (a bug)
    ├── InvalidRequestError        400                    an OpenAI-style request is invalid
    │   └── UnknownModelError      404                    a model this server does not serve
    ├── PoolExhaustedError         503                    too few free KV blocks right now
    ├── CapacityError              503                    a sidecar table is full (names limit)
    ├── FabricNotReadyError        503                    the required READ transport is missing
    ├── StoreError                 422                    a store request or setting is invalid
    └── StartupError               500                    a child process did not become ready

Outside the tree, a pull that fails with a bare ``TimeoutError`` reports ``deadline`` and with any
other exception ``internal`` (:func:`reason_code`); an API answers 500 ``InternalError`` for them.
"""

from __future__ import annotations


class KvxferdError(Exception):
    """Base of every error kvxferd raises on purpose."""

    status: int = 400
    """HTTP status of an API answer for this error (class attribute; see the table above)."""
    code: str = "transfer"
    """Reason code of a pull that fails with this error (class attribute)."""


class ConfigError(KvxferdError):
    """A flag, environment variable or config file value is wrong."""

    status = 500


class PathInUseError(ConfigError):
    """Another running process holds the lock of a path this one must own (a second sidecar
    on a socket, a second engine on a sidecar)."""


class ManifestError(KvxferdError):
    """A manifest (or planner input) is inconsistent; ``field`` names the offending path."""

    status = 422

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UnsupportedModelError(ManifestError):
    """The planner does not know how to lay out this model configuration."""


class BlockIdError(KvxferdError):
    """Block ids that are out of range, duplicated, or given for the wrong group."""

    status = 422
    code = "block_ids"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class MemoryRegionError(KvxferdError):
    """A memory region cannot be created, mapped or has the wrong size."""

    status = 422


class SegmentTooSmallError(MemoryRegionError):
    """A shared-memory segment is smaller than the region registered over it: at registration,
    or since (its owner truncated it), when touching the mapping would kill the sidecar with
    SIGBUS, so it is not touched; ``field`` names the region (HTTP 422)."""

    code = "segment_too_small"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class TransportError(KvxferdError):
    """A NIXL operation failed."""

    status = 502


class RegistrationError(TransportError):
    """Registering or deregistering memory with NIXL failed."""


class PeerDisconnectedError(TransportError):
    """The remote agent disconnected (or was never reachable) during a transfer."""

    code = "peer_disconnected"


class TransferFailedError(TransportError):
    """A posted transfer finished in an error state."""


class TransferTimeoutError(TransportError):
    """A transfer did not complete before its deadline."""

    code = "deadline"


class UnsettledReadError(TransportError):
    """A READ stayed in flight past its settle bound: its destination may still change."""

    code = "unsettled"


class TransportLookupError(TransportError):
    """NIXL found no such remote agent, registration covering the descriptors, or prepped list."""


class DescriptorError(TransportError):
    """Descriptor lists or indices were rejected: bad shape, length mismatch or out of range."""


class HandshakeError(KvxferdError):
    """A peer could not be reached for a handshake, or answered something unusable."""

    status = 502
    code = "handshake"


class IncompatiblePeerError(HandshakeError):
    """Two manifests cannot exchange blocks; ``fields`` lists every disagreement, ``reasons``
    says in words why a field's values cannot work where the values alone do not tell."""

    status = 409
    code = "incompatible"

    def __init__(
        self, fields: dict[str, tuple[object, object]], reasons: dict[str, str] | None = None
    ) -> None:
        why = reasons or {}
        detail = "; ".join(
            f"{k}: {why[k] + ', ' if k in why else ''}local={_short(a)} remote={_short(b)}"
            for k, b, a in _triples(fields)
        )
        super().__init__(f"incompatible peer: {detail}")
        self.fields = fields
        self.reasons = why


def _short(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a peer's manifest strings are input)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _triples(fields: dict[str, tuple[object, object]]) -> list[tuple[str, object, object]]:
    return [(k, remote, local) for k, (local, remote) in fields.items()]


class ClaimTimeoutError(HandshakeError):
    """A claim at a prefill sidecar got no answer in time (the pull reason ``claim_timeout``)."""

    code = "claim_timeout"


class HoldError(KvxferdError):
    """A hold (prefill-side pin of blocks) problem."""

    status = 502


class UnknownHoldError(HoldError):
    """No hold with that id exists (it never did, or it was already released), or it was
    aborted and takes no new reader."""

    status = 404
    code = "unknown_hold"


class HoldExpiredError(HoldError):
    """The hold's lease ran out; its blocks may already be reused."""

    status = 410
    code = "hold_expired"


class HoldRequestError(HoldError):
    """A hold, claim or heartbeat argument is invalid; ``field`` names it."""

    status = 422

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class DuplicateHoldError(HoldRequestError):
    """The request id already has a live hold (``field`` is ``request_id``)."""

    status = 409


class AuthError(KvxferdError):
    """A peer request's signature, or a ticket's MAC, is missing or wrong."""

    status = 401
    code = "auth"


class SignedBeforeStartError(AuthError):
    """A signed peer request whose ``ts`` is before ``not_before``: the process that may have
    seen its nonce is gone (a restart), so it cannot be proven unseen. Sign again at a ts of at
    least ``not_before``."""

    def __init__(self, detail: str, not_before: int = 0) -> None:
        super().__init__(detail)
        self.not_before = not_before


class ClaimMismatchError(AuthError):
    """A validly signed ticket that does not bind to the hold it names (block ids, TP shape,
    reader); ``field`` names what differs (HTTP 409)."""

    status = 409

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotRegisteredError(KvxferdError):
    """The call needs a registered engine and none has registered with this sidecar yet."""

    status = 503


class AlreadyRegisteredError(KvxferdError):
    """The sidecar already has an engine; a new layout needs a new sidecar (restart it)."""

    status = 409


class RegisterInProgressError(AlreadyRegisteredError):
    """Another register is still mapping its memory or running its self-test: transient (the
    vLLM worker tries again, bounded), unlike an engine registered there."""


class PodConflictError(KvxferdError):
    """A pod sidecar's rank (``serve --pod-ranks``) disagrees with the pod: its register names a
    rank already taken or a manifest that differs from the other ranks', its hold placement
    repeats its rank or differs from the first rank's, or it asks a prefill pod to pull;
    ``field`` names what (HTTP 409)."""

    status = 409

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class StaleGenerationError(KvxferdError):
    """The call names a registration generation that is not the current one."""

    status = 409
    field = "generation"  # the offending field, in the API's ErrorBody


class CallExpiredError(KvxferdError):
    """An engine call came after its ``not_after_ns``: the engine had given it up (its client
    timed out) and may have freed or reused the blocks, so it touches nothing (HTTP 408)."""

    status = 408
    field = "not_after_ns"  # the offending field, in the API's ErrorBody


class MemoryInUseError(KvxferdError):
    """Unregister refused: a quarantined (unsettled) READ or a store load or save may still use
    the registered memory, so it stays mapped and registered; a retry succeeds once those ended
    (HTTP 503)."""

    status = 503


class UnknownPullError(KvxferdError):
    """No pull with that id: never started here, or finished so long ago it was forgotten."""

    status = 404


class PullError(KvxferdError):
    """A pull failed; ``reason`` is a short machine-readable code."""

    status = 502
    code = "pull"

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class StateError(KvxferdError):
    """A state machine was asked to move backward or out of a terminal state (a bug)."""

    status = 409

    def __init__(self, current: object, new: object, reason: str) -> None:
        super().__init__(f"{current!r} -> {new!r}: {reason}")
        self.current = current
        self.new = new
        self.reason = reason


class InvalidRequestError(KvxferdError):
    """An OpenAI-style request (completion, chat) is invalid; ``field`` names the culprit."""

    status = 400

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class UnknownModelError(InvalidRequestError):
    """The request's ``model`` is not the one this server serves (HTTP 404)."""

    status = 404


class FabricNotReadyError(KvxferdError):
    """The data plane cannot serve as required (``--require-transport rdma`` but no RDMA, or a
    READ went over TCP), the self-test READ failed, or a registered segment shrank (HTTP 503 on
    /readyz, naming why)."""

    status = 503


class PoolExhaustedError(KvxferdError):
    """Too few free KV blocks for a request right now (HTTP 503; a retry may succeed)."""

    status = 503


class CapacityError(KvxferdError):
    """A sidecar table is full (pulls in flight, live holds): the new entry is refused and a
    retry may succeed; ``field`` names the limit's setting (HTTP 503)."""

    status = 503

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class StoreError(KvxferdError):
    """A store (offload tier) request or setting is invalid; ``field`` names the culprit."""

    status = 422

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class StartupError(KvxferdError):
    """A child process (sidecar, simulated engine) exited or timed out before its ready line."""

    status = 500


def reason_code(exc: BaseException) -> str:
    """The pull failure reason code of any exception (``internal`` for a bug)."""
    if isinstance(exc, KvxferdError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return "deadline"
    return "internal"


def status_of(exc: BaseException) -> int:
    """The HTTP status an API answers for ``exc``: its class's ``status``, 500 if foreign.

    Reads the class attribute, never an instance's own ``status`` (clients set that to the status
    of the answer they got)."""
    return type(exc).status if isinstance(exc, KvxferdError) else 500


def tree() -> list[type[KvxferdError]]:
    """Every class of the tree (this module's), base first, in definition order."""
    out: list[type[KvxferdError]] = []
    todo: list[type[KvxferdError]] = [KvxferdError]
    while todo:
        cls = todo.pop(0)
        if cls.__module__ == __name__ and cls not in out:
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return out
