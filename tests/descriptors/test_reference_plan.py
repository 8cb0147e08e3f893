"""reference_plan: vLLM's descriptor table moves exactly our bytes, in its (larger) count."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest

from kvxferd.descriptors import coalesce, plan_read, reference_descriptor_count
from kvxferd.descriptors.reference import reference_plan
from kvxferd.errors import BlockIdError, ManifestError
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest

from .layouts import render
from .test_views import vllm_like


def _pairs(plan) -> np.ndarray:
    """The plan merged as far as it goes, as sorted rows (both sides, every field)."""
    p = coalesce(plan)
    rows = np.stack([p.local_region, p.local_offset, p.remote_region, p.remote_offset, p.length])
    return rows[:, np.lexsort(rows[::-1])]


@pytest.mark.parametrize("ratio", [1, 4])
def test_moves_the_same_bytes_as_plan_read_in_the_reference_count(ratio):
    m = render(vllm_like(ratio=ratio))
    lids = [np.array([3, 9, 4]), np.array([20, 21])]
    rids = [np.array([7, 1, 2]), np.array([50, 11])]
    ref = reference_plan(m, m, lids, rids)
    ours = plan_read(m, m, lids, rids, coalesce=False)
    assert ref.num_descriptors == reference_descriptor_count(m, lids)
    assert (ref.kv_bytes, ref.state_bytes) == (ours.kv_bytes, ours.state_bytes)
    assert int(ref.length.sum()) == ours.total_bytes
    np.testing.assert_array_equal(_pairs(ref), _pairs(ours))


def test_sd_conv_state_is_one_descriptor():
    spec = vllm_like()
    sd = replace(spec, mamba=replace(spec.mamba, conv_layout="SD"))
    m = render(sd)
    ids = [np.array([], dtype=np.int64), np.array([1, 2])]
    ref = reference_plan(m, m, ids, ids)
    assert ref.num_descriptors == reference_descriptor_count(m, ids) == 2 * 4 * 2
    np.testing.assert_array_equal(_pairs(ref), _pairs(plan_read(m, m, ids, ids)))


@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
def test_planned_mamba2_hybrid_with_kernel_blocks(conv_layout):
    opts = PlanOptions(num_blocks=12, mamba_ssm_cache_dtype="float32", conv_layout=conv_layout)
    m = plan_manifest(load_hf_config("granite-4.0-h-tiny"), opts)
    ids = [np.array([g + 1]) for g in range(len(m.groups))]
    ref = reference_plan(m, m, ids, ids)
    assert ref.num_descriptors == reference_descriptor_count(m, ids)
    assert ref.total_bytes == plan_read(m, m, ids, ids).total_bytes
    np.testing.assert_array_equal(_pairs(ref), _pairs(plan_read(m, m, ids, ids)))


@pytest.mark.parametrize(
    ("name", "opts"),
    [("qwen3-8b", {}), ("qwen3-8b", {"head_layout": "NHD"}), ("gpt-oss-20b", {"cross_layer": True}),
     ("nemotron-h-8b", {"mamba_ssm_cache_dtype": "float32"})],
)  # fmt: skip
def test_vllm_033_reads_a_packed_page_with_one_descriptor_per_layer_and_block(name, opts):
    m = plan_manifest(load_hf_config(name), PlanOptions(num_blocks=24, **opts))
    ids = [np.array([2 * g + 1, 2 * g + 2]) for g in range(len(m.groups))]
    ref = reference_plan(m, m, ids, ids)
    per_block = sum(
        len(layer.conv) + 1 if hasattr(layer, "conv") and layer.conv_layout == "DS"
        else 2 if hasattr(layer, "conv") else 1
        for group in m.groups for layer in group.layers
    )  # fmt: skip
    assert ref.num_descriptors == reference_descriptor_count(m, ids) == 2 * per_block
    np.testing.assert_array_equal(_pairs(ref), _pairs(plan_read(m, m, ids, ids)))


def test_rejects_unequal_tp_and_mismatched_ids():
    m = render(vllm_like())
    with pytest.raises(BlockIdError):
        reference_plan(m, m, [np.array([1]), np.array([2])], [np.array([1, 3]), np.array([2])])
    other = msgspec.structs.replace(m, tp_size=2, tp_rank=1)
    with pytest.raises(ManifestError):
        reference_plan(m, other, [[1], [2]], [[1], [2]])
