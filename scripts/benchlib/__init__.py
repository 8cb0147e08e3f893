"""Private helpers of the benchmark scripts: processes, raw NIXL reads, ucx_perftest, reports."""
