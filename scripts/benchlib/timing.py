"""The benchmark scripts' timer: the median wall time of repeated calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_s(fn: Callable[[], object], repeat: int, warmup: int = 0,
             before_each: Callable[[], object] | None = None) -> float:  # fmt: skip
    """Median wall seconds of ``repeat`` calls of ``fn``, after ``warmup`` untimed ones;
    ``before_each`` (untimed) runs before every timed call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
