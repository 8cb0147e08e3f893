"""Private helpers of scripts/bench_transfer.py: processes, raw NIXL reads, ucx_perftest, report."""
