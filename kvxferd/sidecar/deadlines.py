"""Deadlines of live holds in time buckets: O(1) to add, move or drop, reaped in slices.

A lazy-deletion heap needs an entry per extension and, now and then, a rebuild that costs a
pass over every live hold (tens of ms at 100k holds) in one go. Buckets of ``resolution_s``
never rebuild: a key lives in the heap exactly while its bucket exists, and the number of
buckets is bounded by the longest lease over the resolution. Inside a bucket, order is insertion
order; deadlines closer than the resolution expire in no particular order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class DeadlineBuckets:
    """Item ids keyed by deadline bucket ``floor(deadline / resolution_s)``."""

    def __init__(self, resolution_s: float = 0.05) -> None:
        if not (math.isfinite(resolution_s) and resolution_s > 0):
            raise ValueError(f"resolution_s: must be > 0, got {resolution_s!r}")
        self.resolution_s = float(resolution_s)
        self._buckets: dict[int, dict[str, None]] = {}
        self._keys: list[int] = []  # heap; a key is in it exactly while _buckets has it
        self._where: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    @property
    def buckets(self) -> int:
        """Buckets alive (empty ones included until their time has passed)."""
        return len(self._buckets)

    def key(self, deadline: float) -> int:
        """The bucket of a deadline."""
        return math.floor(deadline / self.resolution_s)

    def set(self, item: str, deadline: float) -> None:
        """Schedule ``item`` at ``deadline`` (moving it if it was elsewhere)."""
        key = self.key(deadline)
        old = self._where.get(item)
        if old == key:
            return
        if old is not None:
            del self._buckets[old][item]
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = {}
            heapq.heappush(self._keys, key)
        bucket[item] = None
        self._where[item] = key

    def drop(self, item: str) -> None:
        """Unschedule ``item`` (no-op when absent); its bucket stays until its time passes."""
        key = self._where.pop(item, None)
        if key is not None:
            del self._buckets[key][item]

    def next_end(self) -> float | None:
        """End time of the earliest non-empty bucket (every deadline in it is at or before it)."""
        keys = self._keys
        while keys and not self._buckets[keys[0]]:
            del self._buckets[heapq.heappop(keys)]
        return (keys[0] + 1) * self.resolution_s if keys else None

    def due(self, now: float, max_items: int, deadline_of: Callable[[str], float]) -> list[str]:
        """Up to ``max_items`` items whose deadline is at or before ``now``, earliest buckets
        first, removed from the schedule. Whole buckets that ended are taken without looking at
        each deadline; the bucket ``now`` falls in is scanned item by item."""
        out: list[str] = []
        keys, res = self._keys, self.resolution_s
        while keys and len(out) < max_items:
            key = keys[0]
            bucket = self._buckets[key]
            if (key - 1) * res > now:  # nothing in it is due (one bucket of slack for rounding)
                break
            ended = (key + 1) * res <= now
            for item in list(bucket):
                if len(out) >= max_items:
                    break
                if ended or deadline_of(item) <= now:
                    del bucket[item]
                    del self._where[item]
                    out.append(item)
            if bucket and not ended:
                break  # the current bucket: what is left is not due yet
            if not bucket:
                heapq.heappop(keys)
                del self._buckets[key]
        return out
