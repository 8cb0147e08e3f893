"""Derived quantities: what `kvxferd layout` prints, checked against vLLM's own numbers."""

from __future__ import annotations

import pytest

from kvxferd.layout import (
    PlanOptions,
    block_ratio,
    kv_bytes_per_token,
    kv_cache_tokens,
    load_hf_config,
    mamba_padding_bytes,
    mamba_padding_fraction,
    mamba_state_bytes,
    page_bytes,
    plan_manifest,
    summarize,
)
from kvxferd.wire import AttentionLayer, MambaLayer


def plan(name: str, **options):
    return plan_manifest(load_hf_config(name), PlanOptions(**options))


def test_granite_state_and_token_sizes():
    m = plan("granite-4.0-h-tiny")
    mamba, attn = m.groups[0].layers[0], m.groups[-1].layers[0]
    assert isinstance(mamba, MambaLayer) and isinstance(attn, AttentionLayer)
    assert mamba_state_bytes(mamba) == (19968, 786432)
    assert kv_bytes_per_token(attn) == 2048
    assert mamba_padding_bytes(m) == 12800
    assert mamba_padding_fraction(m) == pytest.approx(0.01587, abs=1e-5)


def test_qwen35_ratio_and_cache_tokens():
    m = plan("qwen3.5-397b-a17b", tp_size=2, num_blocks=1334)
    assert block_ratio(m.groups[-1]) == 131 and block_ratio(m.groups[0]) == 1
    assert kv_cache_tokens(m) == 1334 // 4 * 2096


def test_pure_attention_has_no_padding_and_page_is_k_plus_v():
    m = plan("llama-3.1-8b")
    assert mamba_padding_bytes(m) == 0 and mamba_padding_fraction(m) == 0.0
    assert page_bytes(m) == 16 * 2 * 8 * 128 * 2


def test_cross_layer_page_is_one_layer_slot():
    m = plan("gpt-oss-20b", cross_layer=True)
    assert page_bytes(m) == 16 * 2 * 8 * 64 * 2
    assert m.regions[0].page_bytes == 12 * page_bytes(m)


def test_summary_rows():
    s = summarize(plan("granite-4.0-h-tiny", num_blocks=10))
    assert (s.page_bytes, s.conv_bytes, s.ssm_bytes, s.kv_bytes_per_token) == (
        819200,
        19968,
        786432,
        2048,
    )
    assert s.total_bytes == 4 * 10 * 819200
    assert [g.kind for g in s.groups].count("mamba") == 9
    attn = s.groups[-1]
    assert (attn.block_size, attn.kernel_block_size, attn.ratio) == (400, 400, 1)
    assert attn.layer_indices == (5, 15, 25, 35) and attn.regions == (0, 1, 2, 3)
    assert len(s.regions[0].layer_names) == 10  # one layer of each of the 10 groups
