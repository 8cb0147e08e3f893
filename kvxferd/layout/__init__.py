"""Pure KV-cache layout: plan manifests from Hugging Face configs, validate them, derive sizes.

``plan_manifest(load_hf_config("granite-4.0-h-tiny"), PlanOptions(tp_size=2))`` gives the
manifest vLLM would allocate; ``validate_manifest`` checks any manifest (ours or an engine's);
the derived helpers give what ``kvxferd layout`` prints.
"""

from kvxferd.layout.derived import (
    GroupSummary,
    LayoutSummary,
    RegionSummary,
    block_ratio,
    kv_bytes_per_token,
    kv_cache_tokens,
    mamba_layers,
    mamba_padding_bytes,
    mamba_padding_fraction,
    mamba_state_bytes,
    page_bytes,
    region_slots,
    request_blocks,
    summarize,
)
from kvxferd.layout.manifest import validate_manifest
from kvxferd.layout.planner import PlanOptions, plan_manifest
from kvxferd.layout.presets import load_hf_config, preset_names

__all__ = [
    "GroupSummary",
    "LayoutSummary",
    "PlanOptions",
    "RegionSummary",
    "block_ratio",
    "kv_bytes_per_token",
    "kv_cache_tokens",
    "load_hf_config",
    "mamba_layers",
    "mamba_padding_bytes",
    "mamba_padding_fraction",
    "mamba_state_bytes",
    "page_bytes",
    "plan_manifest",
    "preset_names",
    "region_slots",
    "request_blocks",
    "summarize",
    "validate_manifest",
]
