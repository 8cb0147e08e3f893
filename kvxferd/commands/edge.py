"""The edge-limit flags of the OpenAI-compatible listeners (``kvxferd sim``, ``kvxferd proxy``).

Head size and read timeouts default to the sidecar's settings (``KVXFERD_MAX_HEADER_BYTES``,
``KVXFERD_HEADER_TIMEOUT_S``, ``KVXFERD_BODY_TIMEOUT_S``) when set, so one environment bounds how
long any kvxferd listener waits for a client; the body size and connection cap are a front
door's own (chat bodies are larger than the sidecar's, its fan-in differs).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvxferd.cli import check_finite_positive
from kvxferd.config import FRONT_DOOR_MAX_BODY_BYTES, FRONT_DOOR_MAX_CONNECTIONS, Config
from kvxferd.errors import ConfigError

if TYPE_CHECKING:  # the CLI parses flags without importing uvicorn
    from kvxferd.api.limits import EdgeLimits

# (flag, EdgeLimits field, type, shared env var or None)
_FLAGS = (
    ("--max-connections", "max_connections", int, None),
    ("--max-header-bytes", "max_header_bytes", int, "KVXFERD_MAX_HEADER_BYTES"),
    ("--max-body-bytes", "max_body_bytes", int, None),
    ("--header-timeout", "header_timeout_s", float, "KVXFERD_HEADER_TIMEOUT_S"),
    ("--body-timeout", "body_timeout_s", float, "KVXFERD_BODY_TIMEOUT_S"),
)
_HELP = {
    "max_connections": "open connections beyond this are closed at once (keep it well below "
    "`ulimit -n`)",
    "max_header_bytes": "largest request head; larger: 400/431, connection closed",
    "max_body_bytes": "largest request body; a larger Content-Length is a 413 before a byte is "
    "read, a chunked body is cut at the limit",
    "header_timeout_s": "seconds a connection has to send its whole request head; then closed",
    "body_timeout_s": "seconds a request body has to arrive after its head; then 408, closed",
}


def front_door_defaults() -> dict[str, int | float]:
    """The built-in limits of an OpenAI-compatible listener (EdgeLimits fields): the sidecar's
    head size and timeouts, the front door's own body size and connection cap."""
    return {
        "max_connections": FRONT_DOOR_MAX_CONNECTIONS,
        "max_header_bytes": Config.max_header_bytes,
        "max_body_bytes": FRONT_DOOR_MAX_BODY_BYTES,
        "header_timeout_s": Config.header_timeout_s,
        "body_timeout_s": Config.body_timeout_s,
    }


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Add the five edge-limit flags to ``p`` (unset: the shared env var, else the default)."""
    defaults = front_door_defaults()
    for flag, name, kind, env in _FLAGS:
        shown = f"{env}, else {defaults[name]:g}" if env else f"{defaults[name]}"
        metavar = "S" if kind is float else "N"
        p.add_argument(flag, type=kind, dest=f"edge_{name}", metavar=metavar,
                       help=f"{_HELP[name]} (default: {shown})")  # fmt: skip


def limits_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> EdgeLimits:
    """The limits the flags, then the shared env vars, then the defaults give (ConfigError
    naming the flag or variable when one is not > 0)."""
    from kvxferd.api.limits import EdgeLimits

    env = os.environ if env is None else env
    defaults = front_door_defaults()
    values: dict[str, int | float] = {}
    for flag, name, kind, var in _FLAGS:
        value, source = getattr(args, f"edge_{name}"), flag
        if value is None and var and env.get(var):
            source = var
            try:
                value = kind(env[var])
            except ValueError:
                raise ConfigError(f"{var}: not a number: {env[var]!r}") from None
        if value is None:
            value = defaults[name]
        check_finite_positive(value, source)
        values[name] = value
    return EdgeLimits(**values)  # type: ignore[arg-type]


def add_event_loop_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--event-loop`` to ``p`` (unset: KVXFERD_EVENT_LOOP, else auto)."""
    from kvxferd.aio import EVENT_LOOPS

    p.add_argument("--event-loop", choices=EVENT_LOOPS, dest="event_loop",
                   help="asyncio, uvloop, or auto: uvloop when installed (default: "
                   "KVXFERD_EVENT_LOOP, else auto)")  # fmt: skip


def event_loop_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str:
    """The event loop the flag, then KVXFERD_EVENT_LOOP, then ``auto`` name (ConfigError naming
    the variable when it holds no loop name)."""
    from kvxferd.aio import check_event_loop

    if args.event_loop:
        return args.event_loop
    raw = (os.environ if env is None else env).get("KVXFERD_EVENT_LOOP") or "auto"
    try:
        return check_event_loop(raw)
    except ConfigError as exc:
        raise ConfigError(f"KVXFERD_EVENT_LOOP: {exc}") from None
