"""The ``kvxferd`` command: ``layout``, ``serve`` (the sidecar), ``proxy``, ``demo`` and ``sim``.

Errors end the command with exit status 2 and one line on stderr: ``kvxferd: error: ...``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence

from kvxferd import __version__
from kvxferd.errors import ConfigError, KvxferdError


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvxferdError as exc:
        print(f"kvxferd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxferd",
        description="KV-cache transfer daemon for disaggregated prefill/decode serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvxferd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from kvxferd.commands import layout, serve

    layout.add_parser(sub)
    serve.add_parser(sub)
    from kvxferd.commands import proxy

    proxy.add_parser(sub)
    from kvxferd.commands import demo

    demo.add_parser(sub)
    from kvxferd.commands import sim

    sim.add_parser(sub)
    return parser


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
"""The levels both Python's logging and uvicorn know (uvicorn has no warn, fatal or notset)."""


def check_log_level(level: str, field: str = "--log-level") -> None:
    """ConfigError naming ``field`` unless ``level`` is one of LOG_LEVELS (any case)."""
    if level.lower() not in LOG_LEVELS:
        raise ConfigError(f"{field}: unknown level {level!r} ({', '.join(LOG_LEVELS)})")


def check_finite_positive(value: float, field: str) -> None:
    """ConfigError naming ``field`` unless ``value`` is > 0 and finite (a NaN or infinite
    timeout would never end a wait, 0 or less would end it at once)."""
    if not 0 < value < math.inf:
        raise ConfigError(f"{field}: must be > 0 and finite, got {value}")


def check_port(port: int, field: str = "--port") -> None:
    """ConfigError naming ``field`` unless ``port`` is a TCP port (0: any free one)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"{field}: {port} is not a TCP port")


def setup_logging(level: str) -> None:
    """Plain %-style logging to stderr for the daemon commands (ConfigError for an unknown
    level)."""
    check_log_level(level)
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
