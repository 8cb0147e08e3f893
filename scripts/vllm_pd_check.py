#!/usr/bin/env python3
"""Prefill -> decode through vLLM's real Scheduler, KV allocation and KvxferdConnector, real
sidecars and NIXL, every pulled byte verified. Run it in .venv-vllm (scripts/vllm-venv.sh):

    .venv-vllm/bin/python scripts/vllm_pd_check.py --config nemotron-h-8b --num-blocks 32 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="config.json path/dir or a bundled name")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument(
        "--prefill-pod",
        action="store_true",
        help="the prefill's ranks share one pod sidecar (serve --pod-ranks)",
    )
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--layout", default="LBHNC", help="vLLM KV cache layout (LBHNC, BLNHC, ...)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.prefill_tp < 1 or args.decode_tp < 1:
        print("vllm_pd_check: --prefill-tp and --decode-tp must be >= 1", file=sys.stderr)
        return 2
    if args.prefill_pod and args.prefill_tp < 2:
        print("vllm_pd_check: --prefill-pod needs --prefill-tp >= 2", file=sys.stderr)
        return 2
    from kvxferd.vllm import pdcheck

    report = pdcheck.run(
        args.config,
        requests=args.requests,
        num_blocks=args.num_blocks,
        layout=args.layout,
        prompt_tokens=args.prompt_tokens,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_pod=args.prefill_pod,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    else:
        print(
            f"{report.model}: {report.requests_ok} ok, {report.requests_failed} failed, "
            f"{report.kv_bytes} KV bytes, {report.state_bytes} state bytes, groups {report.groups}"
        )
    return 0 if report.verified and report.requests_failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
