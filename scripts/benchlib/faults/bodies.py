"""Hostile HTTP at the sidecars' and sims' ports, sent raw over sockets: malformed, deeply
nested, oversized and stalled bodies, huge headers, and bounded connection floods; and hostile
frames at the sidecars' framed peer port (garbage envelopes, oversized or stalled frames,
unsigned or badly typed claims).

Every request must get an answer below 500, or be closed, within a bound: a 5xx is a crashed
handler (``crashes``), no answer in time a ``hangs``. During a flood of a sidecar's peer port its
engine API must keep answering; after it, both APIs.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import dataclass

import msgspec

from kvxferd.wire import FrameAnswer, FrameRequest
from kvxferd.wire.frames import frame

from . import osproc
from .context import Ctx
from .peerauth import peer_headers

ANSWER_BOUND_S = 10.0
"""A server must answer (or close) within this of the last byte we send, a stalled body
included (its read timeout must be shorter)."""
OVERSIZED_BYTES = 48 << 20
FLOOD_CAP = 4096
FLOOD_OVER_LIMIT = 256
"""Connections beyond the target's fd limit (children start with osproc.CHILD_NOFILE)."""


@dataclass(frozen=True)
class Target:
    """Where to send: a Unix socket path or HOST:PORT, the path, and how to authenticate."""

    name: str
    address: str
    path: str
    unix: bool = False
    secret: str = ""
    """Sign as a peer with this secret (peer API); empty: no auth header."""
    framed: bool = False
    """The framed peer port: hostile frames instead of hostile HTTP."""

    def connect(self, timeout_s: float) -> socket.socket:
        if self.unix:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout_s)
            s.connect(self.address)
            return s
        host, port = self.address.rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=timeout_s)


def _head(t: Target, length: int, body_for_auth: bytes, extra: str = "") -> bytes:
    auth = peer_headers("POST", t.path, body_for_auth, t.secret) if t.secret else {}
    lines = [f"POST {t.path} HTTP/1.1", "Host: kvxferd", "Content-Type: application/json",
             f"Content-Length: {length}", "Connection: close",
             *(f"{k}: {v}" for k, v in auth.items())]  # fmt: skip
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def send(t: Target, head: bytes, body: bytes, stall: bool = False) -> tuple[int | None, str]:
    """Send; returns (status, "") or (None, "closed" | "timeout" | error)."""
    try:
        s = t.connect(ANSWER_BOUND_S)
    except OSError as exc:
        return None, f"connect: {exc}"
    with s:
        try:
            s.sendall(head)
            view = memoryview(body)
            for i in range(0, len(body), 1 << 20):
                s.sendall(view[i : i + (1 << 20)])
        except OSError:
            pass  # the server may answer early (413) and close: read what it said
        s.settimeout(ANSWER_BOUND_S)
        data = b""
        end = time.monotonic() + ANSWER_BOUND_S
        try:
            while b"\r\n" not in data and time.monotonic() < end:
                chunk = s.recv(4096)
                if not chunk:
                    return (None, "closed") if not data else _status(data)
                data += chunk
        except TimeoutError:
            return None, "timeout"
        except OSError as exc:
            return None, f"closed ({exc.__class__.__name__})"
        return _status(data) if data else (None, "timeout")


def _status(data: bytes) -> tuple[int | None, str]:
    try:
        return int(data.split(b" ", 2)[1]), ""
    except (IndexError, ValueError):
        return None, f"unparsable answer {data[:40]!r}"


def nested(depth: int) -> bytes:
    return b'{"tickets":' + b"[" * depth + b"]" * depth + b"}"


VARIANTS = ("malformed", "wrong_types", "nested", "oversized", "stalled", "huge_header")


def request(variant: str, t: Target, rng) -> tuple[bytes, bytes, bool]:  # noqa: ANN001
    """(head, body, stalled) of one hostile request."""
    if variant == "malformed":
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512)))
    elif variant == "wrong_types":
        wrong = {"tickets": "x", "block_ids": {"a": 1}, "deadline_s": [None], "request_id": 7,
                 "prompt": {"x": 1}, "model": 3, "max_tokens": "many", "ticket": [],
                 "claim_s": "x"}  # fmt: skip
        body = json.dumps(wrong).encode()
    elif variant == "nested":
        body = nested(rng.choice([1000, 5000, 20000]))
    elif variant == "oversized":
        body = b'{"request_id":"' + b"x" * OVERSIZED_BYTES + b'"}'
    elif variant == "huge_header":
        body = b"{}"
        return _head(t, len(body), body, "X-Pad: " + "a" * (256 << 10)), body, False
    else:  # stalled: announce 1 MB (under any body limit), send one byte, go quiet
        return _head(t, 1_000_000, b""), b"{", True
    return _head(t, len(body), body), body, False


FRAME_VARIANTS = ("garbage", "not_an_envelope", "oversized", "stalled", "unsigned",
                  "wrong_types", "nested")  # fmt: skip


def frame_request(variant: str, t: Target, rng) -> tuple[bytes, bool]:  # noqa: ANN001
    """(bytes, stalled) of one hostile frame to the framed peer port."""
    if variant == "garbage":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512))), False
    if variant == "oversized":  # a header announcing more than any frame limit
        return (1 << 31).to_bytes(4, "big") + b"\x00" * 64, False
    if variant == "stalled":  # announce 1 MB, send one byte, go quiet
        return (1 << 20).to_bytes(4, "big") + b"\x80", True
    if variant == "not_an_envelope":
        return frame(msgspec.msgpack.encode([1, "x", {"deep": [[[]]]}])), False
    if variant == "wrong_types":
        raw = msgspec.msgpack.encode({"ticket": "x", "reader": 7, "claim_s": "soon"})
    elif variant == "nested":  # {"ticket": [[[...]]]}, thousands deep, as raw MessagePack
        raw = b"\x81\xa6ticket" + b"\x91" * rng.choice([1000, 5000, 20000]) + b"\xc0"
    else:
        raw = msgspec.msgpack.encode({"reader": "r"})
    auth = "" if variant == "unsigned" else peer_headers(
        "POST", t.path, raw, t.secret)["Authorization"]  # fmt: skip
    req = FrameRequest(id=1, op=f"POST {t.path}", body=msgspec.Raw(raw), auth=auth)
    return frame(msgspec.msgpack.encode(req)), False


def send_frame(t: Target, data: bytes, stalled: bool) -> tuple[int | None, str]:
    """Send one frame; (status, "") of its answer or (None, "closed" | "timeout" | error). A
    stalled one must be closed by the server's frame timeout (the body timeout: 5 s in the
    campaign) within ANSWER_BOUND_S."""
    try:
        s = t.connect(ANSWER_BOUND_S)
    except OSError as exc:
        return None, f"connect: {exc}"
    with s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        s.settimeout(ANSWER_BOUND_S)
        data = b""
        try:
            while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
                chunk = s.recv(65536)
                if not chunk:
                    return None, "closed"
                data += chunk
        except TimeoutError:
            return None, "timeout"  # a stalled frame must be dropped by the frame timeout
        except OSError as exc:
            return None, f"closed ({exc.__class__.__name__})"
    try:
        return msgspec.msgpack.decode(data[4:], type=FrameAnswer).status, ""
    except msgspec.MsgspecError:
        return None, f"unparsable answer {data[:40]!r}"


def targets(ctx: Ctx) -> list[Target]:
    """Every hostile-body target the campaign runs."""
    pair = ctx.pair
    out = [Target("engine", pair.d.socket, rng_path, unix=True)
           for rng_path in ("/v1/pulls", "/v1/holds", "/v1/keepalive")]  # fmt: skip
    out += [Target("peer", pair.p.peer, path, secret=ctx.secret)
            for path in ("/v1/claims", "/v1/handshake", "/v1/heartbeat")]  # fmt: skip
    if pair.p.peer_frames:
        out += [Target("peer-frames", pair.p.peer_frames, path, secret=ctx.secret, framed=True)
                for path in ("/v1/claims", "/v1/heartbeat")]  # fmt: skip
    if ctx.sims is not None:
        out += ctx.sims.body_targets()  # type: ignore[attr-defined]
    return out


def body(ctx: Ctx, kind: str) -> None:
    """One hostile request to a random API of a random process."""
    t = ctx.rng.choice(targets(ctx))
    if t.framed:
        variant = ctx.rng.choice(FRAME_VARIANTS)
        status, why = send_frame(t, *frame_request(variant, t, ctx.rng))
    else:
        variant = ctx.rng.choice(VARIANTS)
        head, payload, stalled = request(variant, t, ctx.rng)
        status, why = send(t, head, payload, stalled)
    ctx.tally.note(kind, f"{t.name}:{variant}:{status or why.split(' ')[0]}")
    what = f"{variant} body to {t.name} {t.path}"
    if status is not None and status >= 500:
        ctx.tally.violate(kind, "crashes", f"{what}: answered {status}")
    elif status is None and why == "timeout":
        ctx.tally.violate(kind, "hangs", f"{what}: no answer within {ANSWER_BOUND_S:g}s")


def flood(ctx: Ctx, kind: str) -> None:
    """Open (bounded) idle connections to a sidecar's peer port, past its fd limit; its engine
    API must answer meanwhile, both APIs after they close."""
    node = ctx.rng.choice([ctx.pair.p, ctx.pair.d])
    want = min(FLOOD_CAP, osproc.nofile_limit(node.pid) + FLOOD_OVER_LIMIT)
    host, port = node.peer.rsplit(":", 1)
    conns: list[socket.socket] = []
    with osproc.raised_nofile(want + 512):
        try:
            end = time.monotonic() + 20.0
            while len(conns) < want and time.monotonic() < end:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(1.0)
                try:
                    s.connect((host, int(port)))
                except OSError:
                    s.close()
                    continue
                conns.append(s)
            ctx.tally.note(kind, f"{node.name}:{len(conns)}_connections")
            try:
                with node.client(5.0) as c:
                    c.healthz()
            except Exception as exc:  # noqa: BLE001
                ctx.tally.violate(kind, "crashes", f"{node.name} engine API down while its peer "
                                  f"port holds {len(conns)} connections: {exc}"[:200])  # fmt: skip
        finally:
            for s in conns:
                with contextlib.suppress(OSError):
                    s.close()
    time.sleep(1.0)  # let the server notice the closes (a recovery window, not synchronisation)
