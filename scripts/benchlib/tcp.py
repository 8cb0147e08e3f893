"""The kernel's TCP over loopback between two processes: the ceiling of any transport over TCP.

UCX's TCP transport, and so kvxferd's READs with ``UCX_TLS=tcp``, can move bytes no faster than
the kernel's own TCP stack between the same two processes. This measures that stack with no UCX
at all: the bench process sends a buffer of the pull's size over ``streams`` loopback
connections (one sending thread each; ``sendall`` releases the GIL) to a receiver process that
``recv_into``'s preallocated memory and acknowledges each round with one byte per stream.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

RECEIVER = r"""
import socket, struct, sys, threading
port, streams = int(sys.argv[1]), int(sys.argv[2])
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

def serve(c):  # one thread per stream: recv_into releases the GIL
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(0)
    while True:
        (n,) = struct.unpack("<Q", c.recv(8, socket.MSG_WAITALL))
        if n == 0:
            return
        if len(buf) < n:
            buf = bytearray(n)  # its pages fault in during the untimed warm-up round
        view, got = memoryview(buf), 0
        while got < n:
            got += c.recv_into(view[got:n], min(n - got, 1 << 22))
        c.sendall(b"k")

threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""

CHUNK = 1 << 20
"""Bytes per ``sendall``: large enough that the syscall count does not matter."""


class KernelTcp:
    """A receiver process connected over ``streams`` loopback TCP connections."""

    def __init__(self, streams: int, timeout_s: float = 30.0) -> None:
        self.streams = streams
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(streams)
            listener.settimeout(timeout_s)
            port = listener.getsockname()[1]
            self.child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(streams)])
            try:
                self.conns = [listener.accept()[0] for _ in range(streams)]
            except BaseException:
                self.child.kill()
                self.child.wait()
                raise
        finally:
            listener.close()
        for c in self.conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.settimeout(timeout_s)

    def send_s(self, data: np.ndarray) -> float:
        """Seconds to move ``data`` (split evenly over the streams) until every ack is back."""
        raw = memoryview(data).cast("B")
        cuts = np.linspace(0, len(raw), self.streams + 1).astype(int).tolist()
        parts = [raw[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

        def send(conn: socket.socket, part: memoryview) -> None:
            conn.sendall(len(part).to_bytes(8, "little"))
            for off in range(0, len(part), CHUNK):
                conn.sendall(part[off : off + CHUNK])

        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=send, args=cp) for cp in zip(self.conns, parts, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in self.conns:
            if c.recv(1) != b"k":
                raise ConnectionError("the TCP receiver went away")
        return time.perf_counter() - t0

    def close(self) -> None:
        """End the receiver (a zero-length round) and close the connections."""
        for c in self.conns:
            with contextlib.suppress(OSError):  # the receiver may be gone already
                c.sendall((0).to_bytes(8, "little"))
        try:
            self.child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        for c in self.conns:
            c.close()


def ceiling(nbytes: int, warmup: int, repeat: int, streams: tuple[int, ...] = (1, 2)) -> dict:
    """The best median GB/s (1e9 B/s) over ``streams`` connection counts, moving ``nbytes``."""
    data = np.ones(max(1, nbytes), dtype=np.uint8)  # written once: no page faults while timed
    best: dict = {"gbps": None, "streams": None, "by_streams": {}}
    for n in streams:
        link = KernelTcp(n)
        try:
            for _ in range(warmup):
                link.send_s(data)
            rate = statistics.median(nbytes / link.send_s(data) / 1e9 for _ in range(repeat))
        finally:
            link.close()
        best["by_streams"][n] = round(rate, 3)
        if best["gbps"] is None or rate > best["gbps"]:
            best["gbps"], best["streams"] = rate, n
    return best
