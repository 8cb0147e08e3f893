"""VRAM regions shared through CUDA IPC: the engine exports a tensor's storage handle, the
sidecar opens it and registers the same device memory with NIXL.

torch is imported lazily, so DRAM-only deployments and tests never need CUDA.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np

from kvxferd.errors import MemoryRegionError
from kvxferd.memory.region import MemKind, check_region_name, check_region_size


class CudaIpcHandle(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What torch's ``UntypedStorage._share_cuda_`` returns, as plain wire data (no pickle)."""

    device: int
    """CUDA device index of the storage."""
    handle: bytes
    """cudaIpcMemHandle of the allocation holding the storage."""
    storage_size: int
    """Bytes of the storage."""
    storage_offset: int
    """Bytes from the allocation start to the storage start."""
    ref_counter_handle: bytes
    """torch's shared ref-counter file for the producer's storage."""
    ref_counter_offset: int
    """Slot in that ref-counter file."""
    event_handle: bytes | None = None
    """cudaIpcEventHandle to wait on before use, if any."""
    event_sync_required: bool = False
    """Whether the event must be waited on."""

    def to_bytes(self) -> bytes:
        """Compact wire form (msgpack)."""
        return msgspec.msgpack.encode(self)

    def to_base64(self) -> str:
        """Wire form as ASCII, for JSON fields and environment variables."""
        return base64.b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> CudaIpcHandle:
        """Parse :meth:`to_bytes` output; MemoryRegionError if malformed."""
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MemoryRegionError(f"malformed CUDA IPC handle: {exc}") from exc

    @classmethod
    def from_base64(cls, text: str) -> CudaIpcHandle:
        """Parse :meth:`to_base64` output; MemoryRegionError if malformed."""
        try:
            raw = base64.b64decode(text, validate=True)
        except (ValueError, TypeError) as exc:
            raise MemoryRegionError(f"malformed CUDA IPC handle (base64): {exc}") from exc
        return cls.from_bytes(raw)


class CudaIpcRegion:
    """A CUDA storage seen through IPC (a VRAM :class:`RegionSource`).

    :meth:`export` on the engine side wraps a tensor's storage and produces :attr:`handle`;
    :meth:`open` on the sidecar side maps that handle. Both keep the storage alive until close.
    """

    def __init__(self, name: str, storage: Any, handle: CudaIpcHandle, owner: bool) -> None:
        self._name = name
        self._storage: Any = storage
        self._handle = handle
        self._owner = owner
        self._size = int(storage.nbytes())
        self._base_addr = int(storage.data_ptr())
        self._device_id = handle.device

    @classmethod
    def export(cls, tensor: Any, name: str) -> CudaIpcRegion:
        """Export the storage behind CUDA tensor ``tensor`` (whole storage, from its start)."""
        check_region_name(name)
        torch = _require_cuda(name)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            raise MemoryRegionError(f"region {name!r}: export needs a CUDA tensor")
        storage = tensor.untyped_storage()
        fields = storage._share_cuda_()
        return cls(name, storage, _handle_from_share(fields), owner=True)

    @classmethod
    def open(
        cls, name: str, handle: CudaIpcHandle | bytes, size: int, device_id: int
    ) -> CudaIpcRegion:
        """Open an exported handle; check it covers ``size`` bytes on GPU ``device_id``."""
        check_region_name(name)
        check_region_size(size)
        if isinstance(handle, bytes | bytearray):
            handle = CudaIpcHandle.from_bytes(bytes(handle))
        if handle.device != device_id:
            raise MemoryRegionError(
                f"region {name!r}: handle is for device {handle.device}, spec says {device_id}"
            )
        if handle.storage_size < size:
            raise MemoryRegionError(
                f"region {name!r}: handle covers {handle.storage_size} bytes, expected {size}"
            )
        torch = _require_cuda(name)
        if device_id >= torch.cuda.device_count():
            raise MemoryRegionError(
                f"region {name!r}: device_id {device_id} but only "
                f"{torch.cuda.device_count()} CUDA devices"
            )
        torch.cuda._lazy_init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                handle.device,
                handle.handle,
                handle.storage_size,
                handle.storage_offset,
                handle.ref_counter_handle,
                handle.ref_counter_offset,
                handle.event_handle,
                handle.event_sync_required,
            )
        except RuntimeError as exc:
            raise MemoryRegionError(f"region {name!r}: cannot open CUDA IPC handle: {exc}") from exc
        return cls(name, storage, handle, owner=False)

    @property
    def name(self) -> str:
        """Region name."""
        return self._name

    @property
    def size(self) -> int:
        """Bytes of the storage."""
        return self._size

    @property
    def mem(self) -> MemKind:
        """Always VRAM."""
        return "VRAM"

    @property
    def device_id(self) -> int:
        """CUDA device index."""
        return self._device_id

    @property
    def base_addr(self) -> int:
        """Device address of the storage in this process."""
        return self._base_addr

    @property
    def handle(self) -> CudaIpcHandle:
        """The IPC handle (send :meth:`CudaIpcHandle.to_bytes` to the sidecar)."""
        return self._handle

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._storage is None

    def host_view(self) -> np.ndarray:
        """VRAM has no host view: always raises MemoryRegionError."""
        raise MemoryRegionError(f"region {self._name!r} is VRAM; it has no host view")

    def backed_bytes(self) -> int:
        """Always :attr:`size`: the storage reference keeps the allocation whole."""
        return self._size

    def close(self) -> None:
        """Drop this process's reference to the storage. Idempotent."""
        self._storage = None

    def __enter__(self) -> CudaIpcRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CudaIpcRegion({self._name!r}, size={self._size}, device={self._device_id}, "
            f"closed={self.closed})"
        )


def _handle_from_share(fields: tuple[Any, ...]) -> CudaIpcHandle:
    """Build a handle from ``_share_cuda_``'s 8-tuple."""
    device, handle, size, offset, rc_handle, rc_offset, event, event_sync = fields
    return CudaIpcHandle(
        device=int(device),
        handle=_as_bytes(handle),
        storage_size=int(size),
        storage_offset=int(offset),
        ref_counter_handle=_as_bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=None if event is None else _as_bytes(event),
        event_sync_required=bool(event_sync),
    )


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _require_cuda(name: str) -> Any:
    """Import torch and check CUDA, or raise MemoryRegionError("CUDA not available")."""
    try:
        import torch
    except ImportError as exc:
        raise MemoryRegionError(f"region {name!r}: CUDA not available (no torch)") from exc
    if not torch.cuda.is_available():
        raise MemoryRegionError(f"region {name!r}: CUDA not available on this machine")
    return torch
