"""``kvxferd sim``: a simulated OpenAI-compatible engine (prefill, decode or colocated) whose
paged KV pool lives in shared memory, with one kvxferd sidecar per TP rank (started by the sim,
or already running: ``--sidecar-socket``)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from kvxferd.commands.edge import (
    add_event_loop_flag,
    add_limit_flags,
    event_loop_from_args,
    limits_from_args,
)
from kvxferd.errors import ConfigError
from kvxferd.layout import preset_names

if TYPE_CHECKING:
    from kvxferd.sim.server import SimOptions


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the subcommand."""
    p = sub.add_parser(
        "sim",
        help="run a simulated prefill/decode engine with real sidecars",
        description="Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models, "
        "/health and /v1/stats from a simulated engine. Its KV pool (one shared-memory segment "
        "per pooled region and TP rank, laid out by the planner) is filled with a verification "
        "pattern; a prefill holds it for a decode through its sidecars, a decode pulls it, "
        "checks every byte and generates text that is a pure function of those bytes. Prints "
        "'kvxferd sim ready url=http://HOST:PORT role=ROLE tp=N model=NAME' when ready.",
        epilog="The peer secret comes from KVXFERD_PEER_TOKEN (random if unset; prefill and "
        "decode sims that talk to each other need the same one; attached sidecars have their "
        "own). A prefill that knows its sidecars' secret mints its tickets with it, as the "
        "vLLM connector does, and places its holds after answering. Bundled configs: "
        + ", ".join(preset_names()),
    )
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"],
                   help="prefill: hold KV for a decode; decode: pull it; colocated: no "
                   "transfer (the reference output)")  # fmt: skip
    p.add_argument("--config", required=True, metavar="NAME|PATH",
                   help="HF config.json path, or the name of a bundled config")  # fmt: skip
    p.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel size (ranks; default 1)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="HTTP and peer bind address (default 127.0.0.1)"
    )
    p.add_argument(
        "--port", type=int, default=0, metavar="N", help="HTTP port (default 0: any free)"
    )
    p.add_argument("--pool-blocks", type=int, metavar="N",
                   help="logical KV blocks per rank (block 0 is reserved); default: as many as "
                   "fit in 1 GiB over all ranks, at most 4096")  # fmt: skip
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="model name in /v1/models and responses (default: the config's HF name)",
    )
    p.add_argument("--on-pull-failure", choices=["recompute", "fail"], default="recompute",
                   help="decode: prefill locally and go on (counted; the default), or "
                   "answer 502")  # fmt: skip
    p.add_argument("--lease", type=float, metavar="S",
                   help="prefill: hold lease in seconds (default: the sidecar's, 30)")  # fmt: skip
    p.add_argument("--pull-timeout", type=float, default=30.0, metavar="S",
                   help="decode: deadline of one request's pull in seconds "
                   "(default 30)")  # fmt: skip
    p.add_argument("--unanswered-retry", type=float, default=1.0, metavar="S",
                   help="prefill: interval, in seconds, of the aborts retried for a hold whose "
                   "placement and abort both got no answer from a sidecar (its blocks stay "
                   "held until one is answered; default 1)")  # fmt: skip
    p.add_argument("--unanswered-bound", type=float, default=600.0, metavar="S",
                   help="prefill: how long, in seconds, such a hold's blocks wait for the "
                   "sidecar to answer before they are freed unconfirmed (counted "
                   "holds_abandoned; default 600)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", metavar="D",
                   help="auto, bfloat16, float16, fp8...")  # fmt: skip
    p.add_argument("--attn-pack-size", type=int, default=1, metavar="N",
                   help="attention layers sharing one page (hybrids)")  # fmt: skip
    p.add_argument("--sidecar-socket", action="append", dest="sidecar_sockets", default=[],
                   metavar="PATH",
                   help="attach to the running `kvxferd serve` whose engine socket this is "
                   "instead of starting one (repeat once per TP rank, in rank order); it must "
                   "share /dev/shm with the sim")  # fmt: skip
    p.add_argument("--sidecar-timeout", type=float, default=60.0, metavar="S",
                   help="how long to wait for the sidecars to start or, attached, to answer "
                   "/healthz; also the bound of each call to them, in seconds "
                   "(default 60)")  # fmt: skip
    p.add_argument("--store", metavar="DIR", default="",
                   help="prefill: use the sidecars' store in DIR as a prefix-cache tier (hits "
                   "survive restarts; loaded bytes are verified)")  # fmt: skip
    p.add_argument("--store-chunk-tokens", type=int, default=64, metavar="N",
                   help="tokens per store chunk (default 64)")  # fmt: skip
    add_limit_flags(p)
    add_event_loop_flag(p)
    p.add_argument("--log-level", default="info", metavar="LEVEL",
                   help="debug, info, warning, error")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM."""
    from kvxferd.cli import setup_logging
    from kvxferd.sim.server import run_sim

    _check(args)
    setup_logging(args.log_level)
    if logging.getLogger().level <= logging.INFO:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per sidecar call
    return run_sim(options(args))


def options(args: argparse.Namespace) -> SimOptions:
    """The SimOptions of parsed ``kvxferd sim`` flags (checked: ``_check``)."""
    from kvxferd.sim.server import SimOptions

    return SimOptions(
        role=args.role,
        config=args.config,
        tp=args.tp,
        host=args.host,
        port=args.port,
        pool_blocks=args.pool_blocks,
        served_model_name=args.served_model_name,
        on_pull_failure=args.on_pull_failure,
        lease_s=args.lease,
        pull_timeout_s=args.pull_timeout,
        unanswered_retry_s=args.unanswered_retry,
        unanswered_bound_s=args.unanswered_bound,
        kv_cache_dtype=args.kv_cache_dtype,
        attn_pack_size=args.attn_pack_size,
        log_level=args.log_level,
        sidecar_timeout_s=args.sidecar_timeout,
        sidecar_sockets=tuple(args.sidecar_sockets),
        store_dir=args.store,
        store_chunk_tokens=args.store_chunk_tokens,
        limits=limits_from_args(args),
        event_loop=event_loop_from_args(args),
    )


def _check(args: argparse.Namespace) -> None:
    """ConfigError naming the first number flag out of range, before anything starts."""
    from kvxferd.cli import check_finite_positive, check_port

    check_port(args.port)
    for flag, value in (("--lease", args.lease), ("--pull-timeout", args.pull_timeout),
                        ("--sidecar-timeout", args.sidecar_timeout),
                        ("--unanswered-retry", args.unanswered_retry),
                        ("--unanswered-bound", args.unanswered_bound)):  # fmt: skip
        if value is not None:
            check_finite_positive(value, flag)
    if args.unanswered_retry > args.unanswered_bound:  # the bound would pass before one retry
        raise ConfigError(
            f"--unanswered-retry: must be at most --unanswered-bound "
            f"({args.unanswered_bound:g} s), got {args.unanswered_retry:g}"
        )
    if args.pool_blocks is not None and args.pool_blocks < 2:  # 0 is not "the default"
        raise ConfigError(f"--pool-blocks: must be >= 2, got {args.pool_blocks}")
    if args.store_chunk_tokens < 1:
        raise ConfigError(f"--store-chunk-tokens: must be >= 1, got {args.store_chunk_tokens}")
