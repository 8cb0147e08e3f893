"""``kvxferd layout``: how an engine lays out a model's KV cache, and what a request moves."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np

from kvxferd import descriptors
from kvxferd.errors import ConfigError
from kvxferd.layout import (
    LayoutSummary,
    PlanOptions,
    load_hf_config,
    plan_manifest,
    preset_names,
    request_blocks,
    summarize,
)
from kvxferd.wire import MAX_TOKENS, Manifest

MAX_SPECULATIVE_TOKENS = 1024
"""Largest --num-speculative-tokens: past any drafter's proposals (conv rows grow with it)."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the subcommand."""
    p = sub.add_parser(
        "layout",
        help="show a model's KV-cache layout and the bytes a request moves",
        description="Plan the KV-cache layout vLLM would allocate for a Hugging Face config, "
        "and the bytes and descriptors a request of --tokens tokens moves.",
        epilog="Bundled configs: " + ", ".join(preset_names()),
    )
    p.add_argument("--config", required=True, metavar="PATH|NAME",
                   help="HF config.json path, or the name of a bundled config")  # fmt: skip
    p.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)"
    )
    p.add_argument("--kv-cache-dtype", default="auto", metavar="D",
                   help="auto, bfloat16, float16, fp8 (= float8_e4m3fn)...")  # fmt: skip
    p.add_argument("--mamba-cache-dtype", default="auto", metavar="D", help="conv state dtype")
    p.add_argument("--mamba-ssm-dtype", default="auto", metavar="D", help="SSM state dtype")
    p.add_argument("--attn-pack-size", type=int, default=1, metavar="N",
                   help="attention layers sharing one page (hybrids)")  # fmt: skip
    p.add_argument("--cross-layer", action="store_true",
                   help="one tensor per page-size group (blocks, layers, page)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="N",
                   help=f"extra conv state rows for speculative decoding (at most "
                   f"{MAX_SPECULATIVE_TOKENS})")  # fmt: skip
    p.add_argument("--tokens", type=int, default=4096, metavar="T",
                   help=f"request size for the bytes/descriptor figures (1 to "
                   f"{MAX_TOKENS:,}; default 4096)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class RequestCost:
    """What moving one request of ``tokens`` tokens costs for a manifest."""

    tokens: int
    blocks_per_group: tuple[int, ...]
    kv_bytes: int
    state_bytes: int
    descriptors: int
    descriptors_uncoalesced: int
    per_layer_descriptors: int


def run(args: argparse.Namespace) -> int:
    """Print the layout (table or JSON)."""
    if args.tp < 1:
        raise ConfigError(f"--tp: must be >= 1, got {args.tp}")
    if not 1 <= args.tokens <= MAX_TOKENS:
        raise ConfigError(f"--tokens: must be 1 to {MAX_TOKENS}, got {args.tokens}")
    if not 0 <= args.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            f"--num-speculative-tokens: must be 0 to {MAX_SPECULATIVE_TOKENS}, got "
            f"{args.num_speculative_tokens}"
        )
    hf = load_hf_config(args.config)
    options = PlanOptions(
        tp_size=args.tp,
        kv_cache_dtype=_dtype(args.kv_cache_dtype),
        mamba_cache_dtype=_dtype(args.mamba_cache_dtype),
        mamba_ssm_cache_dtype=_dtype(args.mamba_ssm_dtype),
        attn_pack_size=args.attn_pack_size,
        cross_layer=args.cross_layer,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    probe = plan_manifest(hf, options)
    need = request_blocks(probe, args.tokens)
    # Plan again with a pool just big enough for the request (block 0 stays the null block).
    manifest = plan_manifest(hf, _with_blocks(options, sum(need) + 1))
    summary = summarize(manifest)
    cost = request_cost(manifest, args.tokens)
    if args.json:
        print(json.dumps(_as_json(summary, manifest, cost), indent=2))
    else:
        _print_table(summary, cost)
    return 0


def request_cost(manifest: Manifest, tokens: int) -> RequestCost:
    """Bytes and descriptors of moving a ``tokens``-token request between two equal engines."""
    need = request_blocks(manifest, tokens)
    ids, start = [], 1
    for n in need:
        ids.append(np.arange(start, start + n, dtype=np.int64))
        start += n
    plan = descriptors.plan_read(manifest, manifest, ids, ids, coalesce=True)
    flat = descriptors.plan_read(manifest, manifest, ids, ids, coalesce=False)
    return RequestCost(
        tokens=tokens,
        blocks_per_group=tuple(need),
        kv_bytes=int(plan.kv_bytes),
        state_bytes=int(plan.state_bytes),
        descriptors=int(plan.num_descriptors),
        descriptors_uncoalesced=int(flat.num_descriptors),
        per_layer_descriptors=int(descriptors.reference_descriptor_count(manifest, ids)),
    )


def _with_blocks(options: PlanOptions, num_blocks: int) -> PlanOptions:
    from dataclasses import replace

    return replace(options, num_blocks=max(num_blocks, 2))


def _dtype(name: str) -> str:
    return {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
            "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(name, name)  # fmt: skip


def _as_json(s: LayoutSummary, m: Manifest, cost: RequestCost) -> dict[str, object]:
    return {
        "model": s.model,
        "tp_size": s.tp_size,
        "layout": s.layout,
        "attn_pack_size": s.attn_pack_size,
        "block_size": _block_size(m),
        "kernel_block_size": _kernel_block_size(m),
        "page_size_bytes": s.page_bytes,
        "mamba_padding_bytes": s.mamba_padding_bytes,
        "mamba_padding_fraction": s.mamba_padding_fraction,
        "conv_state_bytes": s.conv_bytes,
        "ssm_state_bytes": s.ssm_bytes,
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "num_groups": len(s.groups),
        "group_size": len(s.regions),
        "groups": [{**asdict(g), "num_layers": len(g.layer_indices)} for g in s.groups],
        "regions": [asdict(r) for r in s.regions],
        "request": asdict(cost),
    }


def _block_size(m: Manifest) -> int:
    return max(g.block_size for g in m.groups)


def _kernel_block_size(m: Manifest) -> int:
    attn = [g.kernel_block_size for g in m.groups if g.kind != "mamba"]
    return min(attn) if attn else _block_size(m)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n:,} B"


def _print_table(s: LayoutSummary, cost: RequestCost) -> None:
    print(f"model            {s.model}  (TP {s.tp_size}, {s.layout}, pack {s.attn_pack_size})")
    print(f"page             {s.page_bytes:,} B per block per layer slot")
    if s.conv_bytes or s.ssm_bytes:
        print(f"mamba state      conv {s.conv_bytes:,} B + ssm {s.ssm_bytes:,} B per layer; "
              f"padding {s.mamba_padding_bytes:,} B ({s.mamba_padding_fraction:.2%})")  # fmt: skip
    print(f"kv per token     {s.kv_bytes_per_token:,} B per attention layer")
    print(f"groups           {len(s.groups)}, pooled into {len(s.regions)} regions")
    print()
    print(f"  {'#':>2} {'kind':15} {'block':>6} {'kernel':>6} {'ratio':>5} {'layers':>6}  window")
    for g in s.groups:
        window = str(g.sliding_window) if g.sliding_window else "-"
        print(f"  {g.index:>2} {g.kind:15} {g.block_size:>6} {g.kernel_block_size:>6} "
              f"{g.ratio:>5} {len(g.layer_indices):>6}  {window}")  # fmt: skip
    print()
    print(f"request of {cost.tokens:,} tokens: blocks per group {list(cost.blocks_per_group)}")
    print(f"  bytes to move    KV {_mib(cost.kv_bytes)}, state {_mib(cost.state_bytes)}")
    print(f"  descriptors      {cost.descriptors:,} coalesced "
          f"({cost.descriptors_uncoalesced:,} uncoalesced); "
          f"per-layer K/V-split scheme: {cost.per_layer_descriptors:,}")  # fmt: skip
