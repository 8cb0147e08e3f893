"""The finished-pulls feed: done/failed pulls in finishing order, bounded in records and bytes.

An engine reads it once per step (``since(cursor, limit)``) to learn which requests' blocks
arrived and which local blocks hold invalid bytes. The oldest entries are dropped first when
either bound is reached; a cursor older than the oldest entry continues from the oldest.
"""

from __future__ import annotations

from collections import deque

import msgspec

from kvxferd.wire import MAX_PAGE_ENTRIES, FinishedPull, FinishedPulls

MAX_RECORDS = 65536
"""Entries kept at most."""
MAX_BYTES = 32 << 20
"""Encoded bytes kept at most (a failed pull of 8k blocks costs ~50 KB)."""
PAGE_BYTES = 1 << 20
"""Encoded bytes one page carries at most (always at least one entry)."""
MAX_LIMIT = MAX_PAGE_ENTRIES
"""Largest page size in entries."""


class FinishedFeed:
    """Append-only, bounded, paged by a cursor (the sequence number of the last entry seen)."""

    def __init__(self, max_records: int = MAX_RECORDS, max_bytes: int = MAX_BYTES) -> None:
        self._entries: deque[tuple[int, FinishedPull, int]] = deque()
        self._seq = 0
        self._bytes = 0
        self._max_records = max_records
        self._max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Encoded bytes held."""
        return self._bytes

    def add(self, pull: FinishedPull) -> None:
        """Append one finished pull, dropping the oldest entries past the bounds."""
        size = len(msgspec.json.encode(pull))
        self._seq += 1
        self._entries.append((self._seq, pull, size))
        self._bytes += size
        while self._entries and (
            len(self._entries) > self._max_records or self._bytes > self._max_bytes
        ):
            self._bytes -= self._entries.popleft()[2]

    def since(self, cursor: int, limit: int = 1024) -> FinishedPulls:
        """Entries after ``cursor``: at most ``limit`` (cut to MAX_LIMIT) and PAGE_BYTES."""
        limit = max(1, min(limit, MAX_LIMIT))
        entries = self._entries
        if not entries or entries[-1][0] <= cursor:
            return FinishedPulls(pulls=[], cursor=min(cursor, self._seq))
        # Sequence numbers are consecutive: index of the first entry after the cursor.
        start = max(0, cursor - entries[0][0] + 1)
        out: list[FinishedPull] = []
        size = 0
        last = cursor
        for i in range(start, len(entries)):
            seq, pull, n = entries[i]
            if out and (len(out) >= limit or size + n > PAGE_BYTES):
                break
            out.append(pull)
            size += n
            last = seq
        return FinishedPulls(pulls=out, cursor=last, more=last < entries[-1][0])
