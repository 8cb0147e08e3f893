"""Context-manager lifecycle shared by NIXL handles (transfers, prepped descriptor lists)."""

from __future__ import annotations

import logging
from typing import Self

from kvxferd.errors import KvxferdError

logger = logging.getLogger(__name__)


class ReleasedOnExit:
    """``with handle:`` releases it on exit; a release failure never masks the original error."""

    def release(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.release()
            return
        try:
            self.release()
        except KvxferdError as rel_exc:
            logger.warning("releasing %r after an error failed: %s", self, rel_exc)
