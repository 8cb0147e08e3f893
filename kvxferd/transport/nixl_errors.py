"""Translate NIXL's exceptions into kvxferd's error tree, in one place.

NIXL's messages are bare codes (``NIXL_ERR_NOT_FOUND``), so every translation names the
operation and what it was working on. Matching is by class name, so this module does not need
to import nixl.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvxferd.errors import (
    DescriptorError,
    PeerDisconnectedError,
    TransferFailedError,
    TransportError,
    TransportLookupError,
)

_BY_NAME: dict[str, type[TransportError]] = {
    "nixlRemoteDisconnectError": PeerDisconnectedError,
    "nixlNotFoundError": TransportLookupError,
    "nixlInvalidParamError": DescriptorError,
    "nixlMismatchError": DescriptorError,
    "nixlCancelledError": TransferFailedError,
}

_HINTS: dict[type[TransportError], str] = {
    PeerDisconnectedError: "the remote agent disconnected",
    TransportLookupError: (
        "NIXL found no remote metadata for the agent, no registration covering the "
        "descriptors, or the prepped list is stale"
    ),
    DescriptorError: "NIXL rejected the descriptors or indices",
}


def is_nixl_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the exceptions NIXL's bindings raise."""
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    return name.startswith("nixl") and name.endswith("Error") and "nixl" in module


def translate(
    exc: BaseException, op: str, default: type[TransportError], subject: str
) -> TransportError:
    """The kvxferd error for NIXL exception ``exc`` raised by ``op`` on ``subject``."""
    cls = _BY_NAME.get(type(exc).__name__, default)
    hint = _HINTS.get(cls, "NIXL call failed")
    where = f" ({subject})" if subject else ""
    return cls(f"{op}{where}: {hint} [{type(exc).__name__}: {exc}]")


@contextlib.contextmanager
def nixl_errors(
    op: str, subject: str = "", default: type[TransportError] = TransportError
) -> Iterator[None]:
    """Run a NIXL call; re-raise its exceptions as kvxferd errors (``raise ... from exc``).

    ``default`` is used for errors without a specific mapping (e.g. backend errors), so a
    registration can raise RegistrationError and a poll TransferFailedError.
    """
    try:
        yield
    except Exception as exc:
        if not is_nixl_error(exc):
            raise
        raise translate(exc, op, default, subject) from exc
