"""The sidecar's configuration: one typed, frozen object, loaded once at the edge.

Sources, later wins: built-in defaults < ``KVXFERD_*`` environment variables < CLI flags. Nothing
below the CLI reads ``os.environ``; the object is passed down.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

import msgspec

from kvxferd._docstrings import attribute_docs
from kvxferd.aio import check_event_loop, check_http
from kvxferd.errors import ConfigError
from kvxferd.wire.engine import PEER_HOST_PATTERN
from kvxferd.wire.manifest import EngineId

ENV_PREFIX = "KVXFERD_"

HTTP_SERVER_KEEPALIVE_S = 30.0
"""Idle keep-alive of kvxferd's HTTP servers (sidecar APIs, sim, proxy)."""
HTTP_CLIENT_KEEPALIVE_S = 4.0
"""Idle keep-alive of kvxferd's HTTP clients: below every server's (uvicorn's default is 5 s),
so a client never reuses a connection the server is closing."""
FRONT_DOOR_MAX_CONNECTIONS = 1024
"""Default connection cap of the OpenAI-compatible listeners (``kvxferd sim``, ``proxy``)."""
FRONT_DOOR_MAX_BODY_BYTES = 32 << 20
"""Default body limit of the OpenAI-compatible listeners: chat requests can be large."""


_LIMITS = ("engine_max_connections", "peer_max_connections", "max_header_bytes", "max_body_bytes",
           "max_body_bytes_in_flight", "header_timeout_s", "body_timeout_s")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Config:
    """Settings of one ``kvxferd serve`` process (one engine rank)."""

    engine_socket: str = "/tmp/kvxferd.sock"
    """Unix socket of the engine API (created 0600)."""
    engine_frames_socket: str = ""
    """Unix socket of the engine API's framed protocol (created 0600); empty = the engine socket
    plus ``.frames``, ``off`` = not served."""
    peer_host: str = "127.0.0.1"
    """Address the peer API binds to."""
    peer_port: int = 0
    """TCP port of the peer API; 0 picks a free one."""
    peer_frames_port: int = 0
    """TCP port of the peer API's framed protocol (signed claims, heartbeats, declines; named in
    the handshake); 0 picks a free one, -1 = not served (readers then use HTTP)."""
    advertise_host: str = ""
    """Host other sidecars use to reach this one (a name or IP address, at most 255
    characters); empty = peer_host."""
    peer_token: str = field(default="", repr=False)
    """Shared secret: signs peer requests (never sent) and tickets."""
    peer_token_previous: str = field(default="", repr=False)
    """A second secret accepted during a key rollover (verifies requests and tickets; never
    signs)."""
    auth_skew_s: float = 30.0
    """Replay window of signed peer requests: clock skew tolerated either way, in seconds."""
    hold_grace_s: float = 2.0
    """How long a claim for an engine-chosen hold id waits for the hold to be placed (in a pod:
    placed by every rank)."""
    pod_ranks: int = 1
    """Engine TP ranks served by this one sidecar (a pod sidecar: one agent, one ticket and one
    READ per request for all of them; every rank registers on the engine socket); 1: one rank."""
    pod_register_timeout_s: float = 20.0
    """How long a pod rank's register waits for the pod's other ranks to register (then 503,
    its slot let go, and the worker retries); less than the engine client's 30 s timeout, so the
    answer comes before the client gives up on a call whose slot it still holds."""
    max_claim_s: float = 120.0
    """Longest a claim pins a hold; the claim answer tells the reader what it got."""
    released_feed_bytes: int = 64 << 20
    """Bytes (estimated) of released-hold records kept for the engine's feed."""
    engine_id: str = ""
    """Identity of the engine rank: 1-128 printable ASCII characters, no space (it goes into
    logs, tickets and handshakes); empty = generated at start."""
    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends to create."""
    progress_thread: bool = False
    """Run NIXL's UCX progress thread. Off by default: nixl 1.5's thread busy-polls a whole core
    even when idle; the sidecar's notification poller drives progress instead (every 1 ms while
    a hold is claimed)."""
    default_lease_s: float = 30.0
    """Lease of a hold when the engine gives none."""
    max_lease_s: float = 600.0
    """Upper bound of any lease or heartbeat extension."""
    claim_s: float = 30.0
    """Not used (kept so existing environments still load): a claim lasts what its reader asks,
    the time its pull has left, at most max_claim_s."""
    max_pull_deadline_s: float = 600.0
    """Longest deadline a pull may ask for; a larger ``deadline_s`` is a 422 naming it."""
    max_pulls_in_flight: int = 1024
    """Most pulls running at once; a new pull past it is refused (503 naming the limit)."""
    max_holds: int = 65536
    """Most live holds; a new hold past it is refused (503 naming the limit)."""
    handshake_timeout_s: float = 5.0
    """Bound on one handshake or claim HTTP call."""
    shutdown_grace_s: float = 5.0
    """Seconds from SIGINT/SIGTERM the calls in flight and the store's copies get to end, all
    together; then calls are cancelled, and store I/O still blocked makes exit status 3."""
    log_level: str = "info"
    """Logging level name."""
    engine_max_connections: int = 256
    """Most open connections on the engine socket; more are closed at once. Separate from the
    peer port's, so a flood there never locks the engine out."""
    peer_max_connections: int = 1024
    """Most open connections on the peer port; more are closed at once (keep it well below the
    process's open-file limit, ``ulimit -n``)."""
    max_header_bytes: int = 16384
    """Largest HTTP request head (request line and headers) of both APIs; larger: 400, closed."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest HTTP request body of both APIs: a larger Content-Length answers 413 before a byte
    is read; a chunked body is cut at the limit (413)."""
    max_body_bytes_in_flight: int = 256 << 20
    """Bytes of request bodies each API (HTTP and frames together) holds at once across its
    connections; a body past it waits unread for room, then 503 (HTTP) or closed (frames). At
    least max_body_bytes + max_header_bytes (the largest frame)."""
    header_timeout_s: float = 10.0
    """Seconds a new connection (or a started request head) has to deliver its whole request
    head; then the connection is closed."""
    body_timeout_s: float = 30.0
    """Seconds a request body has to arrive completely after its head; then 408 and closed."""
    store_dir: str = ""
    """Directory of the store's file tier (the KV/state offload tier); empty = no store."""
    store_dram_bytes: int = 1 << 30
    """Bytes the store's host-DRAM pool may hold (LRU beyond)."""
    store_file_bytes: int = 64 << 30
    """Bytes of store files this sidecar keeps in store_dir (LRU beyond; split the budget when
    sidecars share a directory)."""
    store_file_entries: int = 1 << 18
    """Most store files this sidecar keeps in store_dir (LRU beyond, as the bytes): bounds the
    inodes and the index memory (~440 bytes a file) a flood of tiny entries would take."""
    store_chunk_tokens: int = 64
    """Tokens per store chunk (hybrid_chunk_size); every engine sharing a store uses the same."""
    prepped_reads: bool = False
    """Prepare each peer's descriptor lists once per epoch (on a background thread) and post
    READs whose rows coalesce to nothing by index into them (never more descriptors than the
    coalesced tables); off: every READ goes as coalesced tables (the default until an A/B on a
    quiet machine shows it never slower; docs/benchmarks.md)."""
    read_stripes: int = 2
    """Agents a large DRAM READ (8 MiB and up) is split across, each posting its share from a
    thread at once (kvxferd.transport.stripes): on loopback/CMA one READ copies at one core's
    speed, two moved 1.7-1.9x that on 2 cores (scripts/bench_lanes.py). VRAM READs go whole.
    With 2 or more, a smaller DRAM READ goes on a stripe that never notifies, so it needs no
    progress of the prefill and a pull sends its claim first. 1: one agent; at most 8."""
    staging_bytes: int = 64 << 20
    """Bytes of the decode's staging buffer (registered on first use): a READ of at least
    staging_min_descriptors descriptors into host memory is read as whole runs of each prefill
    rank's blocks into it and scattered locally, where that cuts its descriptors 8x or more
    and copies under 16 KiB per descriptor saved (prefill TP 8 into TP 1: 304 -> 16;
    scripts/bench_staging.py). A pull that finds no room reads direct. 0: never staged."""
    staging_min_descriptors: int = 128
    """Descriptors a READ must have before it is staged (fewer: direct; staging costs a local
    copy: 0.87-1.22x the direct READ's time at 76 descriptors, 0.61-0.70x at 152, 0.44-0.47x
    at 304; docs/benchmarks.md)."""
    require_transport: str = "any"
    """READ transport readiness requires: ``rdma`` (an RDMA device, and no READ over TCP; else
    /readyz answers 503 naming why) or ``any``."""
    ucx_proto_log: str = ""
    """File UCX logs its protocol choices to (UCX_PROTO_INFO), read to report the transports
    READs use; empty = a file in the temp directory, ``off`` = not reported."""
    event_loop: str = "auto"
    """Event loop of the process: ``uvloop``, ``asyncio``, or ``auto`` (uvloop when installed).
    Also read by ``kvxferd sim`` and ``kvxferd proxy`` (and passed on to a sim's sidecars)."""
    http: str = "auto"
    """HTTP parser of the engine and peer listeners: ``httptools``, ``h11``, or ``auto``
    (httptools when installed); the same edge limits apply with either."""

    def __post_init__(self) -> None:
        if not 0 <= self.peer_port <= 65535:
            raise ConfigError(f"peer_port: {self.peer_port} is not a TCP port")
        if not -1 <= self.peer_frames_port <= 65535:
            raise ConfigError(
                f"peer_frames_port: {self.peer_frames_port} is not a TCP port (or -1: off)"
            )
        for name in ("default_lease_s", "max_lease_s", "claim_s", "max_pull_deadline_s",
                     "max_pulls_in_flight", "max_holds", "auth_skew_s", "max_claim_s",
                     "released_feed_bytes", "handshake_timeout_s", *_LIMITS):  # fmt: skip
            if not 0 < getattr(self, name) < math.inf:  # nan and inf too: every wait ends
                raise ConfigError(f"{name}: must be > 0 and finite, got {getattr(self, name)}")
        if not 0 <= self.shutdown_grace_s <= 600:
            raise ConfigError(f"shutdown_grace_s: must be in [0, 600], got {self.shutdown_grace_s}")
        if not 0 <= self.hold_grace_s < math.inf:
            raise ConfigError(f"hold_grace_s: must be >= 0 and finite, got {self.hold_grace_s}")
        if self.default_lease_s > self.max_lease_s:
            raise ConfigError("default_lease_s: larger than max_lease_s")
        self._check_body_budget()
        for name in ("store_dram_bytes", "store_file_bytes", "store_file_entries",
                     "store_chunk_tokens"):  # fmt: skip
            if getattr(self, name) < (1 if name == "store_chunk_tokens" else 0):
                raise ConfigError(f"{name}: out of range, got {getattr(self, name)}")
        if not 1 <= self.pod_ranks <= 64:
            raise ConfigError(f"pod_ranks: must be in [1, 64], got {self.pod_ranks}")
        if not 0 < self.pod_register_timeout_s < math.inf:
            raise ConfigError(
                f"pod_register_timeout_s: must be > 0 and finite, got {self.pod_register_timeout_s}"
            )
        if not 0 <= self.staging_bytes <= 1 << 40:
            raise ConfigError(f"staging_bytes: must be in [0, 2**40], got {self.staging_bytes}")
        if self.staging_min_descriptors < 1:
            raise ConfigError(
                f"staging_min_descriptors: must be >= 1, got {self.staging_min_descriptors}"
            )
        if not 1 <= self.read_stripes <= 8:
            raise ConfigError(f"read_stripes: must be in [1, 8], got {self.read_stripes}")
        if self.require_transport not in ("any", "rdma"):
            raise ConfigError(
                f"require_transport: {self.require_transport!r} is not 'rdma' or 'any'"
            )
        if not self.backends:
            raise ConfigError("backends: at least one NIXL backend is needed")
        if self.engine_id:
            try:
                msgspec.convert(self.engine_id, EngineId)
            except msgspec.ValidationError:
                raise ConfigError(
                    f"engine_id: {self.engine_id!r} is not 1-128 printable ASCII characters "
                    "without spaces"
                ) from None
        if not re.search(PEER_HOST_PATTERN, self.advertised_host):
            name = "advertise_host" if self.advertise_host else "peer_host"
            raise ConfigError(
                f"{name}: {self.advertised_host!r} is not a host name or IP address other "
                "sidecars can reach (1-255 of A-Z a-z 0-9 . _ - : % [ ]); tickets carry it"
            )
        check_event_loop(self.event_loop)
        check_http(self.http)

    def _check_body_budget(self) -> None:
        """The body budget must hold the largest frame (a body and its envelope), or such a
        frame would wait for room forever."""
        largest = self.max_body_bytes + self.max_header_bytes
        if self.max_body_bytes_in_flight < largest:
            raise ConfigError(
                f"max_body_bytes_in_flight: {self.max_body_bytes_in_flight} is less than "
                f"max_body_bytes + max_header_bytes ({largest}, the largest frame)"
            )

    @property
    def frames_socket(self) -> str:
        """Where the framed engine API listens; empty when it is off."""
        if self.engine_frames_socket == "off":
            return ""
        return self.engine_frames_socket or frames_socket_of(self.engine_socket)

    @property
    def advertised_host(self) -> str:
        """Host to put in tickets and handshakes."""
        return self.advertise_host or self.peer_host


def frames_socket_of(engine_socket: str) -> str:
    """The default frames socket of a sidecar whose engine socket is ``engine_socket``."""
    return engine_socket + ".frames"


def load_config(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """A Config from ``KVXFERD_<FIELD>`` env vars, then ``overrides`` (None values skipped)."""
    env = os.environ if env is None else env
    hints = get_type_hints(Config)
    values: dict[str, Any] = {}
    for f in fields(Config):
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            values[f.name] = _parse(f.name, hints[f.name], raw)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in hints:
            raise ConfigError(f"{key}: unknown setting")
        values[key] = value
    try:
        return Config(**values)
    except TypeError as exc:  # pragma: no cover - guarded by the key check above
        raise ConfigError(str(exc)) from exc


def replace(config: Config, **changes: Any) -> Config:
    """A copy of ``config`` with some fields changed (validated again)."""
    return dataclasses.replace(config, **changes)


def env_help() -> list[tuple[str, str]]:
    """(env var, meaning) for every setting, for ``--help`` and the operations doc; each meaning
    is one line (a table cell, a help line)."""
    docs = attribute_docs(Config)
    return [
        (ENV_PREFIX + f.name.upper(), " ".join(docs.get(f.name, "").split()))
        for f in fields(Config)
    ]


def _parse(name: str, kind: Any, raw: str) -> Any:
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind == tuple[str, ...]:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        return raw
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}: cannot parse {raw!r}") from None
