"""Descriptor math over a manifest: dual views, id mapping, TP slicing, coalescing, re-blocking.

Pure and numpy-vectorised: no I/O, no NIXL, no addresses. Every descriptor is a (region index,
byte offset from the region base, length) triple; the transport adds base addresses.
"""

from kvxferd.descriptors.coalesce import coalesce, merge_runs
from kvxferd.descriptors.geometry import check_block_ids, check_geometry, kernel_ids
from kvxferd.descriptors.mapping import (
    ReadGeometry,
    compare_manifests,
    plan_pull,
    plan_read,
    read_geometry,
)
from kvxferd.descriptors.plan import ReadPlan
from kvxferd.descriptors.prepped import IndexPlan, PreppedGeometry, prepped_geometry
from kvxferd.descriptors.reblock import (
    ReblockGeometry,
    reblock_fields,
    reblock_geometry,
    token_blocks,
)
from kvxferd.descriptors.reference import reference_descriptor_count
from kvxferd.descriptors.staging import StagedPlan, scatter, stage_plans
from kvxferd.descriptors.tpslice import (
    expected_readers,
    owned_units,
    ranks_read,
    source_ranks,
    unit_holders,
    unit_totals,
)
from kvxferd.descriptors.views import DescriptorView, Views, build_views, desc_ids

__all__ = [
    "DescriptorView",
    "IndexPlan",
    "PreppedGeometry",
    "ReadGeometry",
    "ReadPlan",
    "ReblockGeometry",
    "StagedPlan",
    "Views",
    "reblock_fields",
    "build_views",
    "check_block_ids",
    "check_geometry",
    "coalesce",
    "compare_manifests",
    "desc_ids",
    "expected_readers",
    "kernel_ids",
    "merge_runs",
    "owned_units",
    "plan_pull",
    "plan_read",
    "prepped_geometry",
    "ranks_read",
    "read_geometry",
    "reblock_geometry",
    "reference_descriptor_count",
    "scatter",
    "stage_plans",
    "source_ranks",
    "token_blocks",
    "unit_holders",
    "unit_totals",
]
