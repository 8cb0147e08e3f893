"""The vLLM-scheme descriptor count, our baseline for how much merging saves."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvxferd.descriptors import plan_read, reference_descriptor_count
from kvxferd.errors import BlockIdError

from .layouts import render
from .test_views import vllm_like


def test_counts_k_and_v_per_kernel_block_and_four_per_ds_mamba_layer():
    m = render(vllm_like(ratio=4))  # 2 attention layers, 4 mamba2 layers (x, B, C, ssm)
    ids = [np.arange(10), np.arange(10, 13)]
    assert reference_descriptor_count(m, ids) == 10 * 2 * 4 * 2 + 3 * 4 * 4


def test_sd_and_single_section_mamba_count_two():
    spec = vllm_like()
    sd = replace(spec, mamba=replace(spec.mamba, conv_layout="SD",
                                     sections=(("conv_x", 2, 2), ("conv_b", 1, 2),
                                               ("conv_c", 1, 2))))  # fmt: skip
    assert reference_descriptor_count(render(sd), [[], [1, 2]]) == 2 * 4 * 2
    m1 = replace(spec, mamba=replace(spec.mamba, mamba_type="mamba1", sections=(("conv_x", 2, 2),)))
    assert reference_descriptor_count(render(m1), [[], [1, 2]]) == 2 * 4 * 2


def test_merged_scheme_halves_attention_and_quarters_mamba_descriptors():
    m = render(vllm_like(ratio=4))
    ids = [np.array([3, 9, 4]), np.array([20, 21])]
    plan = plan_read(m, m, ids, ids, coalesce=False)
    # attention: [K|V] is one descriptor (2 layers x 3 ids x 4 kernel blocks), vLLM splits it;
    # mamba: [x|B|C|ssm] is one descriptor (4 layers x 2 ids), vLLM uses four.
    assert plan.num_descriptors == 24 + 8
    assert reference_descriptor_count(m, ids) == 2 * 24 + 4 * 8
    assert plan_read(m, m, ids, ids).num_descriptors < plan.num_descriptors


def test_wrong_number_of_groups():
    with pytest.raises(BlockIdError):
        reference_descriptor_count(render(vllm_like()), [[1]])
