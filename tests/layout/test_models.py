"""Config readers: each family's HF fields become one neutral geometry, in vLLM layer order."""

from __future__ import annotations

import pytest

from kvxferd.errors import ManifestError, UnsupportedModelError
from kvxferd.layout import load_hf_config
from kvxferd.layout.models import read_geometry
from kvxferd.layout.states import mamba_state


def kinds(name: str) -> list[str]:
    return [layer.kind for layer in read_geometry(load_hf_config(name)).layers]


def attention_indices(name: str) -> list[int]:
    geom = read_geometry(load_hf_config(name))
    return [layer.index for layer in geom.layers if layer.kind != "mamba"]


def test_granite_layer_types_put_attention_at_5_15_25_35():
    assert attention_indices("granite-4.0-h-tiny") == [5, 15, 25, 35]
    assert kinds("granite-4.0-h-tiny").count("mamba") == 36


def test_granite_mamba2_geometry_and_dtype():
    geom = read_geometry(load_hf_config("granite-4.0-h-tiny"))
    assert geom.mamba is not None and geom.attention is not None
    assert (geom.mamba.mamba_type, geom.mamba.num_heads, geom.mamba.head_dim) == ("mamba2", 48, 64)
    assert geom.mamba.intermediate == 3072  # mamba_expand * hidden_size
    assert (geom.attention.num_kv_heads, geom.attention.head_size) == (4, 128)  # 1536 / 12
    assert geom.dtype == "bfloat16" and geom.ssm_dtype_hint is None and geom.is_hybrid


def test_qwen35_reads_nested_text_config_and_its_ssm_dtype_hook():
    geom = read_geometry(load_hf_config("qwen3.5-397b-a17b"))
    assert attention_indices("qwen3.5-397b-a17b") == list(range(3, 60, 4))
    assert geom.mamba is not None and geom.mamba.mamba_type == "gdn"
    assert (geom.mamba.num_k_heads, geom.mamba.num_v_heads) == (16, 64)
    assert geom.ssm_dtype_hint == "float32"
    assert geom.layers[0].name == "model.layers.0.linear_attn"


def test_qwen3_next_has_no_ssm_dtype_hook():
    geom = read_geometry(load_hf_config("qwen3-next-80b-a3b"))
    assert geom.ssm_dtype_hint is None
    assert len(attention_indices("qwen3-next-80b-a3b")) == 12


def test_nemotron_pattern_skips_mlp_layers_and_defaults_ssm_to_float32():
    cfg = load_hf_config("nemotron-h-8b")
    geom = read_geometry(cfg)
    assert len(geom.layers) == 28  # 24 M + 4 *, the 24 '-' MLP layers hold no KV
    assert kinds("nemotron-h-8b").count("full_attention") == 4
    assert geom.ssm_dtype_hint == "float32"
    assert read_geometry({**cfg, "mamba_ssm_cache_dtype": "float16"}).ssm_dtype_hint == "float16"


def test_jamba_attention_every_period_at_offset_and_mamba1():
    assert attention_indices("jamba-mini-1.5") == [4, 12, 20, 28]
    geom = read_geometry(load_hf_config("jamba-mini-1.5"))
    assert geom.mamba is not None and geom.mamba.mamba_type == "mamba1"
    assert geom.mamba.intermediate == 8192


def test_falcon_h1_has_attention_and_mamba_in_every_layer_attention_first():
    geom = read_geometry(load_hf_config("falcon-h1-0.5b"))
    assert len(geom.layers) == 72
    assert [(x.index, x.kind) for x in geom.layers[:2]] == [(0, "full_attention"), (0, "mamba")]
    assert geom.mamba is not None and geom.mamba.intermediate == 1536  # mamba_d_ssm


def test_gpt_oss_alternates_sliding_and_full_with_window_128():
    geom = read_geometry(load_hf_config("gpt-oss-20b"))
    assert kinds("gpt-oss-20b")[:3] == ["sliding_window", "full_attention", "sliding_window"]
    assert geom.sliding_window == 128 and not geom.is_hybrid


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_dense_models_are_all_full_attention(name):
    assert set(kinds(name)) == {"full_attention"}


def test_unknown_model_type_names_it_and_the_needed_fields():
    with pytest.raises(UnsupportedModelError) as err:
        read_geometry({"model_type": "rwkv7"})
    assert err.value.field == "hf_config.model_type"
    assert "'rwkv7'" in err.value.reason and "num_key_value_heads" in err.value.reason
    assert "linear_num_value_heads" in err.value.reason


def test_missing_field_is_named():
    cfg = dict(load_hf_config("granite-4.0-h-tiny"))
    del cfg["mamba_d_state"]
    with pytest.raises(ManifestError) as err:
        read_geometry(cfg)
    assert err.value.field == "hf_config.mamba_d_state"


def test_layer_types_length_must_match_num_hidden_layers():
    cfg = {**load_hf_config("gpt-oss-20b"), "num_hidden_layers": 23}
    with pytest.raises(ManifestError) as err:
        read_geometry(cfg)
    assert err.value.field == "hf_config.layer_types"


@pytest.mark.parametrize(
    ("preset", "change", "field"),
    [("llama-3.1-8b", {"num_hidden_layers": "x"}, "hf_config"),
     ("llama-3.1-8b", {"num_key_value_heads": 1e400}, "hf_config"),
     ("llama-3.1-8b", {"layer_types": 5}, "hf_config"),
     ("llama-3.1-8b", {"torch_dtype": 5}, "hf_config.torch_dtype"),
     ("llama-3.1-8b", {"torch_dtype": "bogus"}, "hf_config.torch_dtype"),
     ("jamba-mini-1.5", {"attn_layer_period": 0}, "hf_config"),
     ("qwen3-next-80b-a3b", {"text_config": 5}, "hf_config")],
    ids=["str", "inf", "not-a-list", "dtype-type", "dtype-name", "zero-period", "text-config"],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_a_manifest_error_not_a_crash(preset, change, field):
    """``kvxferd layout --config`` and ``kvxferd sim --config`` read user files: a bad value is
    one error line, never a traceback."""
    with pytest.raises(ManifestError) as err:
        read_geometry({**load_hf_config(preset), **change})
    assert err.value.field == field


class TestMambaStateShapes:
    """vLLM's MambaStateShapeCalculator, per rank (SD orientation is (state_len, dim))."""

    def test_granite_tp1(self):
        state = mamba_state(read_geometry(load_hf_config("granite-4.0-h-tiny")).mamba, 1, 0)
        assert state.conv_shape("SD") == [3, 3328] and state.conv_shape("DS") == [3328, 3]
        assert state.ssm_shape == (48, 64, 128)

    def test_mamba2_single_group_is_replicated_over_tp(self):
        state = mamba_state(read_geometry(load_hf_config("granite-4.0-h-tiny")).mamba, 4, 0)
        # n_groups 1 -> 4 groups, one per rank: 12 heads * 64 + 2 * 128.
        assert state.conv_dim == 12 * 64 + 2 * 128
        assert [(s.name, s.units, s.units_total) for s in state.sections] == [
            ("conv_x", 12, 48),
            ("conv_b", 1, 1),
            ("conv_c", 1, 1),
        ]

    def test_nemotron_h_8b_conv_split_matches_nixl_cases(self):
        geom = read_geometry(load_hf_config("nemotron-h-8b")).mamba
        for tp, split in ((1, (8192, 1024, 1024)), (4, (2048, 256, 256))):
            state = mamba_state(geom, tp, 0)
            assert tuple(s.units * s.unit_channels for s in state.sections) == split

    def test_gdn_qwen35_tp2_and_spec_tokens_add_conv_rows(self):
        geom = read_geometry(load_hf_config("qwen3.5-397b-a17b")).mamba
        state = mamba_state(geom, 2, 0)
        assert state.conv_shape("SD") == [3, 6144] and state.ssm_shape == (32, 128, 128)
        assert mamba_state(geom, 2, 2).state_len == 5

    def test_mamba1_ignores_spec_tokens(self):
        geom = read_geometry(load_hf_config("jamba-mini-1.5")).mamba
        state = mamba_state(geom, 2, 3)
        assert state.conv_shape("SD") == [3, 4096] and state.ssm_shape == (4096, 16)

    def test_indivisible_heads_name_tp_size(self):
        geom = read_geometry(load_hf_config("qwen3-next-80b-a3b")).mamba
        with pytest.raises(ManifestError) as err:
            mamba_state(geom, 3, 0)
        assert err.value.field == "options.tp_size"
