"""NIXL's exceptions leave the transport as kvxferd errors naming the operation."""

from __future__ import annotations

import pytest

from kvxferd.errors import (
    DescriptorError,
    PeerDisconnectedError,
    RegistrationError,
    TransferFailedError,
    TransportError,
    TransportLookupError,
)
from kvxferd.transport import is_nixl_error, nixl_errors


def _nixl_exception(name: str) -> type[Exception]:
    """A class shaped like the bindings' exceptions (name and module are what is matched)."""
    return type(name, (Exception,), {"__module__": "nixl_cu13._bindings"})


@pytest.mark.parametrize(
    ("nixl_name", "ours"),
    [
        ("nixlRemoteDisconnectError", PeerDisconnectedError),
        ("nixlNotFoundError", TransportLookupError),
        ("nixlInvalidParamError", DescriptorError),
        ("nixlCancelledError", TransferFailedError),
        ("nixlBackendError", RegistrationError),
        ("nixlUnknownError", RegistrationError),
    ],
)
def test_each_nixl_error_maps_to_its_type_with_op_and_subject(nixl_name, ours):
    exc = _nixl_exception(nixl_name)("NIXL_ERR_X")
    with pytest.raises(ours) as info, nixl_errors("register", "region 'kv0'", RegistrationError):
        raise exc
    assert info.value.__cause__ is exc
    assert "register (region 'kv0')" in str(info.value)
    assert nixl_name in str(info.value)


def test_default_is_plain_transport_error():
    with pytest.raises(TransportError) as info, nixl_errors("get notifs"):
        raise _nixl_exception("nixlBackendError")("boom")
    assert type(info.value) is TransportError


def test_foreign_exceptions_pass_through_untouched():
    with pytest.raises(KeyError), nixl_errors("anything"):
        raise KeyError("x")
    assert not is_nixl_error(ValueError("nixl"))
    assert is_nixl_error(_nixl_exception("nixlNotFoundError")())


@pytest.mark.nixl
def test_real_bindings_exceptions_are_recognised():
    bindings = pytest.importorskip("nixl._bindings")
    assert is_nixl_error(bindings.nixlRemoteDisconnectError("x"))
    assert is_nixl_error(bindings.nixlNotFoundError("x"))
