"""Backend URLs and round-robin choice over them (pure; separate cycles for prefill and decode)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvxferd.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    """One OpenAI-compatible server: its role in the P/D pair and its base URL (no ``/v1``)."""

    role: str
    url: str


def normalize_url(url: str, field: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all name the same server base.

    Refused: a port that is not one, a query or fragment (paths are appended to the base), and
    credentials (never sent, and the URL shows in every error a client gets)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not 0-65535)
    except ValueError as exc:
        raise ConfigError(f"{field}: {url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{field}: {url!r} is not an http(s) URL like http://127.0.0.1:8100")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{field}: a backend URL must not carry credentials (user:password@)")
    if parts.query or parts.fragment:
        raise ConfigError(f"{field}: {url!r}: a backend URL has no query or fragment")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base


class RoundRobin:
    """Cycles through backends in the order given; each call to :meth:`next` is one request."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ConfigError(f"--{role}: at least one URL is required")
        self.backends = tuple(Backend(role, normalize_url(u, f"--{role}")) for u in urls)
        self._cycle = itertools.cycle(self.backends)

    def next(self) -> Backend:
        """The backend for the next request."""
        return next(self._cycle)
