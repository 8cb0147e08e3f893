"""``kvxferd proxy``: the toy P/D proxy in front of prefill and decode servers."""

from __future__ import annotations

import argparse

from kvxferd.aio import run as run_main
from kvxferd.commands.edge import (
    add_event_loop_flag,
    add_limit_flags,
    event_loop_from_args,
    limits_from_args,
)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the subcommand."""
    p = sub.add_parser(
        "proxy",
        help="OpenAI-compatible P/D proxy: prefill (1 token), then decode with the KV params",
        description="Send each completion to a prefill server with max_tokens=1 and the "
        "kv_transfer_params stub, then the original request with the returned kv_transfer_params "
        "to a decode server, streaming its answer back. Round-robin over each list. Works with "
        "`kvxferd sim` and with vLLM servers running a P/D KV connector.",
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill server base URLs, e.g. http://127.0.0.1:8100")  # fmt: skip
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode server base URLs")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, metavar="N",
                   help="TCP port (default 8000; 0 = any free)")  # fmt: skip
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="default of the connect, first-byte and idle timeouts (default 30)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        metavar="S",
        help="bound on connecting to a backend (default: --timeout)",
    )
    p.add_argument(
        "--first-byte-timeout",
        type=float,
        metavar="S",
        help="bound on the first byte of a backend's answer: the prefill's answer, a "
        "streaming decode's headers (default: --timeout)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        metavar="S",
        help="bound on the silence between chunks of an answer; a stream is never "
        "cut while bytes keep coming (default: --timeout)",
    )
    p.add_argument("--generation-timeout", type=float, default=600.0, metavar="S",
                   help="first-byte bound of a non-streaming decode, whose first byte is its "
                   "whole answer: the longest generation (default 600)")  # fmt: skip
    add_limit_flags(p)
    add_event_loop_flag(p)
    p.add_argument("--log-level", default="warning", metavar="LEVEL",
                   help="debug, info, warning, error")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM."""
    from kvxferd.cli import check_finite_positive, check_port, setup_logging
    from kvxferd.proxy import ProxySettings, RoundRobin, serve_proxy

    for flag in ("timeout", "connect_timeout", "first_byte_timeout", "idle_timeout",
                 "generation_timeout"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            check_finite_positive(value, f"--{flag.replace('_', '-')}")
    check_port(args.port)
    limits = limits_from_args(args)
    event_loop = event_loop_from_args(args)
    RoundRobin("prefill", args.prefill)  # validates the URLs before binding anything
    RoundRobin("decode", args.decode)
    setup_logging(args.log_level)
    settings = ProxySettings(
        tuple(args.prefill),
        tuple(args.decode),
        args.timeout,
        connect_s=args.connect_timeout,
        first_byte_s=args.first_byte_timeout,
        idle_s=args.idle_timeout,
        generation_s=args.generation_timeout,
    )
    run_main(serve_proxy(settings, args.host, args.port, args.log_level, limits), event_loop)
    return 0
