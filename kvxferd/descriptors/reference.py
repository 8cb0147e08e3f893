"""Descriptor count of vLLM's NixlConnector scheme, the baseline our counts are compared to.

vLLM addresses each attention layer per kernel block with separate K and V descriptors, and
each mamba layer per logical block with one descriptor per conv section plus one for the SSM
state when the conv state is DS-split (x, B, C, ssm), else two (conv, ssm).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxferd.descriptors.geometry import kernel_ratio
from kvxferd.errors import BlockIdError
from kvxferd.wire import AttentionLayer, Manifest


def reference_descriptor_count(manifest: Manifest, block_ids_per_group: Sequence) -> int:
    """Descriptors per side vLLM's per-layer, per-kernel-block, K/V-split scheme would use."""
    if len(block_ids_per_group) != len(manifest.groups):
        raise BlockIdError(
            "block_ids",
            f"{len(block_ids_per_group)} id lists for {len(manifest.groups)} groups",
        )
    total = 0
    for g, (group, ids) in enumerate(zip(manifest.groups, block_ids_per_group, strict=True)):
        per_block = 0
        for layer in group.layers:
            if isinstance(layer, AttentionLayer):
                per_block += 2 * kernel_ratio(group, f"groups[{g}]")
            elif layer.conv_layout == "DS":
                per_block += len(layer.conv) + 1
            else:
                per_block += 2
        total += per_block * len(ids)
    return total
