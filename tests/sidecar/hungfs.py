"""A hung disk for real: a FUSE filesystem, served from this process over ``/dev/fuse``, that
answers what finding and listing its (empty) root directory takes until a given request (by
default the lookup of a temporary's name, ``*.tmp``, as a file is about to be created; or the
opening of the directory to list it): from then on it reads no request.

A process that creates a file in it (or lists it) then blocks inside the kernel on a request
nobody takes,
as it would on a hard-mounted NFS whose server went away: SIGTERM does not end the wait, SIGKILL
does. (A request the server has read but not answered could not be killed either: the kernel
waits it out uninterruptibly.) ``close`` unmounts (lazily) and aborts the connection, which
fails every request still waiting.

Mounting needs CAP_SYS_ADMIN and ``/dev/fuse``: :func:`mountable` says whether this process has
both. Only the kernel's FUSE protocol (``linux/fuse.h``, x86-64/arm64 little-endian) is spoken,
by hand: no library.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import stat
import struct
import threading
from collections.abc import Callable

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header: len opcode unique nodeid uid gid pid ..
_OUT = struct.Struct("<IiQ")  # fuse_out_header: len error unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
_ATTR_OUT = struct.Struct("<QII")  # fuse_attr_out before its fuse_attr
_OPEN_OUT = struct.Struct("<QII")  # fuse_open_out
_INIT_IN = struct.Struct("<IIII")  # fuse_init_in: major minor max_readahead flags
_INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # fuse_init_out, 64 bytes

_LOOKUP, _FORGET, _GETATTR, _RELEASE, _INIT = 1, 2, 3, 18, 26
_OPENDIR, _READDIR, _RELEASEDIR, _INTERRUPT, _BATCH_FORGET = 27, 28, 29, 36, 42
_NO_REPLY = {_FORGET, _INTERRUPT, _BATCH_FORGET}
_ROOT = 1
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2

Trigger = Callable[[int, bytes], bool]
"""Whether the filesystem hangs after answering this request (its opcode and body)."""


def creating(opcode: int, body: bytes) -> bool:
    """The lookup of a temporary's name (``*.tmp``): a create of it comes next."""
    return opcode == _LOOKUP and body.rstrip(b"\0").endswith(b".tmp")


def listing(opcode: int, body: bytes) -> bool:
    """The opening of the directory: reading its names comes next."""
    return opcode == _OPENDIR


_BUF = 1 << 20  # more than any request (max_write 64 KiB + headers)


def mountable() -> str:
    """Why this process cannot mount one ("" when it can)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if os.geteuid() != 0:
        return "mounting FUSE needs root (CAP_SYS_ADMIN)"
    return ""


class HungFs:
    """A FUSE mount on ``mountpoint`` (an empty directory) that hangs after ``trigger``.

    ``hung`` is set once it stopped reading requests after ``trigger`` and a request waits for
    it: the process that asked is blocked in the kernel."""

    def __init__(self, mountpoint: str, trigger: Trigger = creating) -> None:
        self.mountpoint = mountpoint
        self._trigger = trigger
        self.hung = threading.Event()
        self._stop = threading.Event()
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        self._umount2 = libc.umount2
        opts = f"fd={self._fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
        if libc.mount(b"kvxferd-hungfs", os.fsencode(mountpoint), b"fuse",
                      _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:  # fmt: skip
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"mount fuse on {mountpoint}: {os.strerror(err)}")
        self._thread = threading.Thread(target=self._serve, name="hungfs", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Unmount (lazily) and abort the connection: requests still waiting fail (ENOTCONN)."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._umount2(os.fsencode(self.mountpoint), _MNT_DETACH)
        os.close(self._fd)

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        hanging = False
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            if hanging:  # a request waits and nobody will read it
                self.hung.set()
                self._stop.wait()
                return
            try:
                data = os.read(self._fd, _BUF)
            except OSError as exc:  # ENODEV: unmounted; EINTR/ENOENT: a request went away
                if exc.errno == errno.ENODEV:
                    return
                continue
            _len, opcode, unique, nodeid, *_ = _IN.unpack_from(data)
            body = data[_IN.size :]
            if opcode in _NO_REPLY:
                continue
            error, payload = self._answer(opcode, nodeid, body)
            with contextlib.suppress(OSError):  # (ENOENT: interrupted, nobody waits for it)
                os.write(self._fd, _OUT.pack(_OUT.size + len(payload), -error, unique) + payload)
            hanging = self._trigger(opcode, body)

    @staticmethod
    def _answer(opcode: int, nodeid: int, body: bytes) -> tuple[int, bytes]:
        """(errno, reply payload) of one request."""
        if opcode == _INIT:
            major, minor, readahead, _flags = _INIT_IN.unpack_from(body)
            return 0, _INIT_OUT.pack(7, min(minor, 31), readahead, 0, 16, 12, 65536, 1, 32, 0,
                                     0, 0)  # fmt: skip
        if opcode == _GETATTR and nodeid == _ROOT:
            attr = _ATTR.pack(_ROOT, 0, 0, 0, 0, 0, 0, 0, 0, stat.S_IFDIR | 0o700, 2,
                              os.getuid(), os.getgid(), 0, 4096, 0)  # fmt: skip
            return 0, _ATTR_OUT.pack(0, 0, 0) + attr  # never cached: asked again each time
        if opcode == _LOOKUP:
            return errno.ENOENT, b""  # an empty directory
        if opcode == _OPENDIR:
            return 0, _OPEN_OUT.pack(0, 0, 0)
        if opcode in (_READDIR, _RELEASEDIR, _RELEASE):
            return 0, b""  # READDIR: no entries (not even . and ..: callers skip them anyway)
        return errno.ENOSYS, b""
