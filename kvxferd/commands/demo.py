"""``kvxferd demo``: the whole P/D flow on one machine, verified byte for byte (``make demo``)."""

from __future__ import annotations

import argparse
import json
import signal
from types import FrameType

from kvxferd.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the subcommand."""
    p = sub.add_parser(
        "demo",
        help="run prefill/decode sims, sidecars and the proxy on loopback and verify the bytes",
        description="Start a prefill sim and a decode sim (one kvxferd sidecar per TP rank, real "
        "NIXL transfers over loopback), a colocated reference sim and the proxy; send requests "
        "through the proxy with the openai client (completions and chat, some streaming, some "
        "repeated prompts); compare every answer with the colocated one and print a summary. "
        "Exits 1 unless everything verified.",
    )
    p.add_argument("--config", default=None, metavar="PATH|NAME",
                   help="HF config.json path or bundled name (default granite-4.0-h-tiny, "
                        "a Mamba2/attention hybrid)")  # fmt: skip
    p.add_argument(
        "--prefill-tp", type=int, default=1, metavar="N", help="prefill TP size (default 1)"
    )
    p.add_argument(
        "--decode-tp", type=int, default=1, metavar="N", help="decode TP size (default 1)"
    )
    p.add_argument("--requests", type=int, default=32, metavar="N",
                   help="requests to send (default 32)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=4, metavar="N",
                   help="requests in flight (default 4)")  # fmt: skip
    p.add_argument("--pool-blocks", type=int, default=None, metavar="N",
                   help="KV blocks per sim pool (default: sized to fit memory)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, metavar="N", help="workload seed (default 0)")
    p.add_argument("--store", metavar="DIR", default="",
                   help="prefill sims keep and reuse KV in a store in DIR (a prefix-cache tier; "
                   "run twice with the same DIR to see hits across a full restart)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 only when every request verified."""
    for name in ("prefill_tp", "decode_tp", "requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.pool_blocks is not None and args.pool_blocks < 1:
        raise ConfigError("--pool-blocks: must be >= 1")
    try:
        from kvxferd.demo import DEFAULT_CONFIG, DemoOptions, render, run_demo
    except ImportError as exc:  # openai is a dev extra; `make demo` installs it
        raise ConfigError(f"the demo needs `pip install -e '.[dev]'` ({exc})") from exc
    from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest

    config = load_hf_config(args.config or DEFAULT_CONFIG)  # fail fast, before any process starts
    for tp in {args.prefill_tp, args.decode_tp}:
        plan_manifest(config, PlanOptions(tp_size=tp))
    options = DemoOptions(
        config=args.config or DEFAULT_CONFIG,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        requests=args.requests,
        concurrency=args.concurrency,
        pool_blocks=args.pool_blocks,
        seed=args.seed,
        store_dir=args.store,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: children stopped, not orphaned
    summary = run_demo(options)
    print(json.dumps(summary.as_dict()) if args.json else render(summary), flush=True)
    return 0 if summary.verified else 1


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM becomes SIGINT, which asyncio.run turns into a clean cancel of the run."""
    signal.raise_signal(signal.SIGINT)
