"""Listening sockets we bind ourselves before handing them to uvicorn (so port 0 works, the
Unix socket is 0600, and a bind error names the setting). No heavy imports: the proxy and the
sim use it too."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat

from kvxferd.errors import ConfigError, PathInUseError


def lock_socket_path(path: str, field: str = "engine_socket") -> int:
    """Hold ``path``'s lock file (``path + ".lock"``) for as long as the returned fd stays open.

    A second sidecar on the same socket is refused while the first runs (it would replace the
    first's socket file, and the engine would register the same memory twice)."""
    return hold_lock(path + ".lock", field, f"{path} is in use by a running sidecar")


def hold_lock(lock: str, field: str, in_use: str) -> int:
    """Hold an exclusive flock on the file ``lock`` (made 0600, our pid written in it) for as
    long as the returned fd stays open; the kernel drops it only with its process. The file
    stays: unlinking it would let two processes lock two different files. PathInUseError
    (``field: in_use (pid N)``) while another process holds it, ConfigError if it cannot be
    opened or locked."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot open {lock}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            holder = ""
        finally:
            os.close(fd)
        raise PathInUseError(f"{field}: {in_use} (pid {holder or 'unknown'})") from None
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"{field}: cannot lock {lock}: {exc.strerror}") from exc
    with contextlib.suppress(OSError):  # the pid only names the holder; the lock is held
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def bind_unix(path: str, field: str = "engine_socket") -> socket.socket:
    """Bind a 0600 Unix stream socket at ``path``, replacing a socket file left there (stale
    once :func:`lock_socket_path` holds ``path``)."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ConfigError(f"{field}: {path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{field}: cannot bind {path}: {exc.strerror}") from exc
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def bind_tcp(host: str, port: int, field: str = "peer_port") -> socket.socket:
    """Bind a TCP listening socket (port 0 picks a free one); ``field`` names the setting in
    the ConfigError a failed bind raises (``peer_port``, ``--port``)."""
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on sockets whose proto says TCP,
    # and accepted sockets inherit it; without it small answers wait ~40 ms on delayed ACKs.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{field}: cannot bind {host}:{port}: {exc.strerror}") from exc
    except OverflowError:  # a port outside 0-65535
        sock.close()
        raise ConfigError(f"{field}: {port} is not a TCP port (0-65535)") from None
    sock.listen(1024)
    return sock
