"""``kvxferd serve``: run the sidecar of one engine rank."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

from kvxferd.aio import EVENT_LOOPS, HTTP_PARSERS, loop_factory
from kvxferd.aio import run as run_main
from kvxferd.config import Config, env_help, load_config, replace
from kvxferd.errors import ConfigError

_UNIX_PATH_MAX = 107  # sun_path is 108 bytes on Linux, NUL included
_EXIT_STATUSES = """Exit status: 0 once stopped by SIGINT/SIGTERM; 2 for a bad setting; 3 when
shutdown left store I/O blocked (a hung disk): the sidecar then says so in one line and
exits at once instead of waiting for it (EXIT_STORE_STUCK, kvxferd.sidecar.offload)."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the subcommand."""
    env_lines = "\n".join(f"  {name:32s} {doc}" for name, doc in env_help())
    p = sub.add_parser(
        "serve",
        help="run the sidecar of one engine rank",
        description="Run a kvxferd sidecar: the engine API on a Unix socket (0600) and the peer "
        "API (handshake, claims, /metrics, /healthz, /readyz) on TCP; claims also as signed "
        "frames on a second TCP port.",
        epilog=_EXIT_STATUSES
        + "\n\nEvery setting can also come from the environment (flags win):\n"
        + env_lines,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine-socket", metavar="PATH", help="engine API Unix socket path")
    p.add_argument("--engine-frames-socket", metavar="PATH",
                   help="framed engine API socket, or off "
                   "(default: engine socket + .frames)")  # fmt: skip
    p.add_argument("--peer-host", metavar="HOST", help="peer API bind address")
    p.add_argument("--peer-port", type=int, metavar="N", help="peer API TCP port (0 = any free)")
    p.add_argument("--peer-frames-port", type=int, metavar="N",
                   help="framed peer API TCP port for claims (0 = any free, -1 = off)")  # fmt: skip
    p.add_argument("--advertise-host", metavar="HOST", help="host other sidecars use for us")
    p.add_argument(
        "--peer-token-file",
        metavar="PATH",
        help="file holding the shared peer secret (else KVXFERD_PEER_TOKEN)",
    )
    p.add_argument(
        "--peer-token-previous-file",
        metavar="PATH",
        help="file holding a second accepted secret during a key rollover "
        "(else KVXFERD_PEER_TOKEN_PREVIOUS)",
    )
    p.add_argument("--auth-skew", type=float, dest="auth_skew_s", metavar="S",
                   help="replay window of signed peer requests in seconds")  # fmt: skip
    p.add_argument("--hold-grace", type=float, dest="hold_grace_s", metavar="S",
                   help="seconds a claim waits for an engine-chosen hold")  # fmt: skip
    p.add_argument("--pod-ranks", type=int, dest="pod_ranks", metavar="N",
                   help="serve all N TP ranks of one engine from this sidecar (each rank "
                   "registers on the engine socket; one ticket and one READ per request; "
                   "prefill only; store calls name their rank); default 1")  # fmt: skip
    p.add_argument("--pod-register-timeout", type=float, dest="pod_register_timeout_s",
                   metavar="S",
                   help="seconds a pod rank's register waits for the others, then 503 "
                   "(default 20: under the engine client's 30 s timeout)")  # fmt: skip
    p.add_argument("--max-claim", type=float, dest="max_claim_s", metavar="S",
                   help="longest a claim pins a hold in seconds")  # fmt: skip
    p.add_argument("--engine-id", metavar="ID",
                   help="engine rank identity: 1-128 printable ASCII characters, no space "
                   "(default: random)")  # fmt: skip
    p.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                   help="NIXL backend (repeatable)")  # fmt: skip
    p.add_argument("--lease", type=float, dest="default_lease_s", metavar="S",
                   help="default hold lease in seconds")  # fmt: skip
    p.add_argument("--max-lease", type=float, dest="max_lease_s", metavar="S",
                   help="longest lease or extension in seconds")  # fmt: skip
    p.add_argument("--max-pull-deadline", type=float, dest="max_pull_deadline_s", metavar="S",
                   help="longest deadline a pull may ask for in seconds")  # fmt: skip
    p.add_argument("--max-pulls-in-flight", type=int, dest="max_pulls_in_flight", metavar="N",
                   help="most pulls running at once (more: 503)")  # fmt: skip
    p.add_argument("--max-holds", type=int, dest="max_holds", metavar="N",
                   help="most live holds (more: 503)")  # fmt: skip
    p.add_argument("--log-level", metavar="LEVEL",
                   help="debug, info, warning, error or critical")  # fmt: skip
    p.add_argument("--store-dir", metavar="PATH", help="store file-tier directory (enables it)")
    p.add_argument("--store-dram-bytes", type=int, metavar="N", help="store DRAM pool bytes")
    p.add_argument("--store-file-bytes", type=int, metavar="N", help="store file-tier bytes")
    p.add_argument("--store-file-entries", type=int, metavar="N",
                   help="most store files kept (LRU beyond, as the bytes)")  # fmt: skip
    p.add_argument("--store-chunk-tokens", type=int, metavar="N", help="tokens per store chunk")
    p.add_argument("--prepped-reads", action=argparse.BooleanOptionalAction, default=None,
                   dest="prepped_reads",
                   help="post fragmented READs by index into per-peer prepared lists "
                        "(default: off)")  # fmt: skip
    p.add_argument("--staging-bytes", type=int, metavar="N", dest="staging_bytes",
                   help="bytes of the buffer fan-in READs are staged in before a local scatter "
                        "(0: off; default 64 MiB)")  # fmt: skip
    p.add_argument("--staging-min-descriptors", type=int, metavar="N",
                   dest="staging_min_descriptors",
                   help="descriptors a READ must have to be staged (default 128)")  # fmt: skip
    p.add_argument(
        "--read-stripes",
        type=int,
        metavar="N",
        dest="read_stripes",
        help="agents a large DRAM READ is split across, posted at once; with 2 or more, small "
        "READs use one that never notifies, so a pull claims while it reads (default 2)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="S",
        dest="shutdown_grace_s",
        help="seconds from SIGINT/SIGTERM the calls in flight and the store's copies get to "
        "end, together; then calls are cancelled and the process exits",
    )
    p.add_argument("--require-transport", choices=("rdma", "any"), dest="require_transport",
                   help="refuse readiness unless READs can use RDMA (never TCP)")  # fmt: skip
    p.add_argument("--event-loop", choices=EVENT_LOOPS, dest="event_loop",
                   help="asyncio, uvloop, or auto: uvloop when installed (default)")  # fmt: skip
    p.add_argument("--http", choices=HTTP_PARSERS, dest="http",
                   help="HTTP parser of the listeners: httptools, h11, or auto: httptools when "
                        "installed (default)")  # fmt: skip
    p.add_argument("--ucx-proto-log", metavar="PATH|off", dest="ucx_proto_log",
                   help="file UCX logs its protocol choices to (default: a temp file)")  # fmt: skip
    _show_defaults(p)
    p.set_defaults(func=run)


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """Append Config's default to each flag's help that does not state one already."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for action in p._actions:
        value = defaults.get(action.dest)
        if action.help and value not in (None, "") and "(default" not in action.help:
            shown = ",".join(value) if isinstance(value, tuple) else value
            action.help += f" (default: {shown})"


def run(args: argparse.Namespace) -> int:
    """Load the config (env, then flags), check it, and serve until SIGINT/SIGTERM.

    Every check that needs no NIXL runs before the server module is imported (NIXL and torch
    take seconds to import), so a wrong flag or a missing token fails at once.
    """
    config = _load(args)
    check_startable(config)
    from kvxferd.api.server import serve
    from kvxferd.cli import setup_logging
    from kvxferd.transport import ucxenv

    setup_logging(config.log_level)
    ucxenv.no_memtype_cache()  # before the agent: VRAM mapped through CUDA IPC registers
    run_main(serve(_with_proto_log(config)), config.event_loop)
    return 0


def _with_proto_log(config: Config) -> Config:
    """Turn UCX's protocol log on (before the agent exists) unless it is ``off``."""
    if config.ucx_proto_log == "off":
        return config
    from kvxferd.transport import fabric

    path = config.ucx_proto_log or os.path.join(
        tempfile.gettempdir(), f"kvxferd-ucx-proto-{os.getpid()}.log"
    )
    enabled = fabric.enable(path)
    return replace(config, ucx_proto_log=str(enabled) if enabled else "off")


def _read_secret(path: str | None, flag: str) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"{flag}: {exc.strerror}: {path}") from exc


def _load(args: argparse.Namespace) -> Config:
    token = _read_secret(args.peer_token_file, "--peer-token-file")
    previous = _read_secret(args.peer_token_previous_file, "--peer-token-previous-file")
    return load_config(
        {
            "engine_socket": args.engine_socket,
            "engine_frames_socket": args.engine_frames_socket,
            "peer_host": args.peer_host,
            "peer_port": args.peer_port,
            "peer_frames_port": args.peer_frames_port,
            "advertise_host": args.advertise_host,
            "peer_token": token,
            "peer_token_previous": previous,
            "auth_skew_s": args.auth_skew_s,
            "hold_grace_s": args.hold_grace_s,
            "pod_ranks": args.pod_ranks,
            "pod_register_timeout_s": args.pod_register_timeout_s,
            "max_claim_s": args.max_claim_s,
            "engine_id": args.engine_id,
            "backends": tuple(args.backends) if args.backends else None,
            "default_lease_s": args.default_lease_s,
            "max_lease_s": args.max_lease_s,
            "max_pull_deadline_s": args.max_pull_deadline_s,
            "max_pulls_in_flight": args.max_pulls_in_flight,
            "max_holds": args.max_holds,
            "shutdown_grace_s": args.shutdown_grace_s,
            "log_level": args.log_level,
            "store_dir": args.store_dir,
            "store_dram_bytes": args.store_dram_bytes,
            "store_file_bytes": args.store_file_bytes,
            "store_file_entries": args.store_file_entries,
            "store_chunk_tokens": args.store_chunk_tokens,
            "require_transport": args.require_transport,
            "prepped_reads": args.prepped_reads,
            "read_stripes": args.read_stripes,
            "staging_bytes": args.staging_bytes,
            "staging_min_descriptors": args.staging_min_descriptors,
            "ucx_proto_log": args.ucx_proto_log,
            "event_loop": args.event_loop,
            "http": args.http,
        }
    )


def check_startable(config: Config) -> None:
    """ConfigError for what would stop the sidecar later: no peer token, an unknown log level,
    an event loop that is not installed, an engine socket whose directory is missing or whose
    path is too long for AF_UNIX, a frames socket at the engine socket's path."""
    if not config.peer_token:
        raise ConfigError(
            "no peer token: set KVXFERD_PEER_TOKEN or --peer-token-file (peers must authenticate)"
        )
    from kvxferd.cli import check_log_level

    check_log_level(config.log_level, "log_level")
    loop_factory(config.event_loop)  # uvloop asked for by name must be installed
    path = config.engine_socket
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"engine_socket: {path}: directory {folder} does not exist")
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise ConfigError(
            f"engine_socket: {path}: longer than {_UNIX_PATH_MAX} bytes (the AF_UNIX limit)"
        )
    frames = config.frames_socket
    if frames and os.path.abspath(frames) == os.path.abspath(path):
        raise ConfigError(
            f"engine_frames_socket: {frames} is the engine socket; give the frames their own "
            "path (or off)"
        )
    if frames and len(os.fsencode(frames)) > _UNIX_PATH_MAX:
        raise ConfigError(
            f"engine_frames_socket: {frames}: longer than {_UNIX_PATH_MAX} bytes (the AF_UNIX "
            "limit; set --engine-frames-socket or off)"
        )
