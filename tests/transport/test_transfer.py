"""Transfer's state machine: forward-only, failures sticky, release idempotent and counted.

NIXL is replaced by a scripted stand-in here: this checks bookkeeping only; the bytes are
checked against real NIXL in test_agent.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvxferd.errors import PeerDisconnectedError, TransferFailedError, TransferTimeoutError
from kvxferd.transport import Transfer, TransferState


class nixlRemoteDisconnectError(Exception):  # noqa: N801 - the name is what gets matched
    __module__ = "nixl_cu13._bindings"


class _Handle:
    def __init__(self) -> None:
        self.releases = 0

    def release(self) -> None:
        self.releases += 1


class _ScriptedNixl:
    """Answers check_xfer_state from a script: strings are returned, exceptions raised."""

    def __init__(self, post: str, checks: list[object]) -> None:
        self.post, self.checks = post, list(checks)

    def transfer(self, handle: object) -> str:
        return self.post

    def check_xfer_state(self, handle: object) -> str:
        step = self.checks.pop(0) if self.checks else "PROC"
        if isinstance(step, Exception):
            raise step
        return step

    def get_xfer_telemetry(self, handle: object) -> SimpleNamespace:
        return SimpleNamespace(totalBytes=4096, descCount=1, postDuration=5, xferDuration=20)


def _transfer(post: str, checks: list[object]):
    released: list[Transfer] = []
    handle = _Handle()
    xfer = Transfer(
        _ScriptedNixl(post, checks),
        handle,
        remote="peer",
        nbytes=4096,
        descriptors=1,
        capture_telemetry=True,
        on_release=released.append,
    )
    xfer._post()
    return xfer, handle, released


def test_done_is_final_and_telemetry_is_in_seconds():
    xfer, _, _ = _transfer("PROC", ["PROC", "DONE", "ERR"])
    assert xfer.poll() is TransferState.POSTED
    assert xfer.telemetry() is None
    assert xfer.poll() is TransferState.DONE
    assert xfer.poll() is TransferState.DONE  # the scripted "ERR" is never asked for
    tel = xfer.telemetry()
    assert tel is not None
    assert (tel["bytes"], tel["descriptors"], tel["post_s"], tel["transfer_s"]) == (
        4096,
        1,
        5e-6,
        2e-5,
    )


def test_post_that_completes_immediately_is_done():
    xfer, _, _ = _transfer("DONE", [])
    assert xfer.state is TransferState.DONE


def test_failure_is_sticky_and_typed():
    xfer, _, _ = _transfer("PROC", [nixlRemoteDisconnectError("gone"), "DONE"])
    assert xfer.poll() is TransferState.FAILED
    assert xfer.poll() is TransferState.FAILED
    assert isinstance(xfer.error, PeerDisconnectedError)
    with pytest.raises(PeerDisconnectedError, match="peer"):
        xfer.wait(1.0)


def test_err_status_fails_the_transfer():
    xfer, _, _ = _transfer("PROC", ["ERR"])
    with pytest.raises(TransferFailedError, match="ERR"):
        xfer.wait(1.0)


def test_wait_past_deadline_raises_timeout_and_leaves_it_posted():
    xfer, _, _ = _transfer("PROC", [])
    with pytest.raises(TransferTimeoutError, match="4096 B in 1 descs from 'peer'"):
        xfer.wait(0.01)
    assert xfer.state is TransferState.POSTED


def test_release_is_idempotent_reports_once_and_fails_an_unfinished_transfer():
    xfer, handle, released = _transfer("PROC", [])
    with xfer:
        pass
    xfer.release()
    assert handle.releases == 1 and released == [xfer]
    assert xfer.state is TransferState.FAILED
    assert isinstance(xfer.error, TransferFailedError)
