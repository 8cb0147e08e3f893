"""A TCP listener on loopback that a forged ticket names as its prefill peer.

It accepts any connection, reads what arrives (bounded in bytes and time), answers 503 and
closes, and records each contact and whether the peer secret appeared in what it received: the
secret must never reach it, and with a ticket MAC checked before any network call, nothing
should connect at all.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass

_READ_LIMIT = 1 << 20
_READ_TIMEOUT_S = 2.0
_ANSWER = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass
class Contact:
    """One connection the listener accepted."""

    data: bytes
    secret_seen: bool


class ForgedPeer:
    """Start with :meth:`start`; ``address`` is HOST:PORT; :meth:`take` returns new contacts."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._contacts: list[Contact] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forged-peer", daemon=True)

    def start(self) -> ForgedPeer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def take(self) -> list[Contact]:
        """Contacts since the last call."""
        with self._lock:
            out, self._contacts = self._contacts, []
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                data = self._read(conn)
                with self._lock:
                    self._contacts.append(Contact(data, self._secret in data))
                with contextlib.suppress(OSError):
                    conn.sendall(_ANSWER)

    @staticmethod
    def _read(conn: socket.socket) -> bytes:
        conn.settimeout(_READ_TIMEOUT_S)
        chunks, total = [], 0
        try:
            while total < _READ_LIMIT:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if _complete(b"".join(chunks)):
                    break
        except (TimeoutError, OSError):
            pass
        return b"".join(chunks)


def _complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP request (headers plus Content-Length bytes)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return True
    return True
