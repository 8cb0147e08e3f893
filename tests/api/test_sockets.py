"""Sockets bound before uvicorn gets them: the engine socket is 0600 and replaces a stale one but
never a regular file; a TCP bind that fails names the setting it came from."""

from __future__ import annotations

import os
import stat

import pytest

from kvxferd.api.sockets import bind_tcp, bind_unix, lock_socket_path
from kvxferd.errors import ConfigError


def test_the_unix_socket_is_0600_and_replaces_a_stale_socket(tmp_path):
    path = str(tmp_path / "e.sock")
    stale = bind_unix(path)
    stale.close()  # a crashed sidecar leaves its socket file behind
    sock = bind_unix(path)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    finally:
        sock.close()


def test_a_regular_file_in_the_way_is_never_removed(tmp_path):
    path = tmp_path / "e.sock"
    path.write_text("keep me")
    with pytest.raises(ConfigError, match="^engine_socket: .* exists and is not a socket"):
        bind_unix(str(path))
    assert path.read_text() == "keep me"


def test_a_socket_path_is_locked_once_until_its_holder_lets_go(tmp_path):
    path = str(tmp_path / "e.sock")
    held = lock_socket_path(path)
    try:
        with pytest.raises(ConfigError, match=rf"^engine_frames_socket: {path} is in use by a "
                           rf"running sidecar \(pid {os.getpid()}\)$"):  # fmt: skip
            lock_socket_path(path, "engine_frames_socket")
    finally:
        os.close(held)
    os.close(lock_socket_path(path))


def test_a_failed_tcp_bind_names_the_setting():
    taken = bind_tcp("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        for field in ("peer_port", "--port"):
            with pytest.raises(ConfigError, match=f"^{field}: cannot bind 127.0.0.1:{port}"):
                bind_tcp("127.0.0.1", port, field)
    finally:
        taken.close()


@pytest.mark.parametrize("port", [70000, -1])
def test_a_port_outside_the_tcp_range_names_the_setting(port):
    """``kvxferd sim --port 70000`` ended in an OverflowError traceback."""
    with pytest.raises(ConfigError, match=f"^--port: {port} is not a TCP port"):
        bind_tcp("127.0.0.1", port, "--port")


def test_tcp_listener_says_tcp_so_asyncio_sets_nodelay_on_accepted_connections():
    """Without proto=IPPROTO_TCP asyncio skips TCP_NODELAY and small answers stall ~40 ms."""
    import asyncio
    import socket as _socket

    from kvxferd.api.sockets import bind_tcp

    listener = bind_tcp("127.0.0.1", 0)
    assert listener.proto == _socket.IPPROTO_TCP
    port = listener.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(500):  # bounded: the handler runs on the next loop turns
                if seen:
                    break
                await asyncio.sleep(0.001)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
