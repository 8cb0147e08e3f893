"""Per-family Hugging Face config readers that produce one neutral :class:`ModelGeometry`.

The planner never looks at a raw config: each supported ``model_type`` is read here into the
layer list (in vLLM's construction order) and the attention / Mamba geometry it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvxferd.errors import KvxferdError, ManifestError, UnsupportedModelError
from kvxferd.wire import DTYPE_BYTES

LayerKind = Literal["full_attention", "sliding_window", "mamba"]

NEEDED_FIELDS = (
    "model_type, num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, "
    "head_dim (or hidden_size / num_attention_heads), torch_dtype, the layer pattern "
    "(layer_types, hybrid_override_pattern, attn_layer_period/offset, full_attention_interval), "
    "and for Mamba/GDN layers: the state fields (mamba_n_heads, mamba_d_head, mamba_d_state, "
    "mamba_n_groups, mamba_d_conv, mamba_expand; or linear_num_key_heads, "
    "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim)"
)
"""What the planner reads, quoted by :class:`UnsupportedModelError`."""


@dataclass(frozen=True)
class AttentionGeometry:
    """Head geometry shared by every attention layer of a model (whole model, not per rank)."""

    num_heads: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class MambaGeometry:
    """State geometry of the model's Mamba/GDN mixers (whole model, not per rank).

    mamba1: ``intermediate`` channels, ``state_size``. mamba2: ``num_heads`` x ``head_dim``
    (= intermediate), ``n_groups`` B/C groups of ``state_size``. gdn: ``num_k_heads`` x
    ``head_k_dim`` queries/keys and ``num_v_heads`` x ``head_v_dim`` values.
    """

    mamba_type: Literal["mamba1", "mamba2", "gdn"]
    conv_kernel: int
    intermediate: int = 0
    state_size: int = 0
    num_heads: int = 0
    head_dim: int = 0
    n_groups: int = 0
    num_k_heads: int = 0
    num_v_heads: int = 0
    head_k_dim: int = 0
    head_v_dim: int = 0


@dataclass(frozen=True)
class LayerSpec:
    """One KV-holding layer in construction order (a Falcon-H1 layer contributes two)."""

    index: int
    name: str
    kind: LayerKind


@dataclass(frozen=True)
class ModelGeometry:
    """Everything the planner needs from a config, family differences already resolved."""

    model_type: str
    name: str
    dtype: str
    layers: tuple[LayerSpec, ...]
    attention: AttentionGeometry | None
    mamba: MambaGeometry | None
    sliding_window: int | None = None
    ssm_dtype_hint: str | None = None
    """SSM cache dtype the model's vLLM hook picks under ``--mamba-ssm-cache-dtype auto``."""
    chunk_size: int | None = None
    """Mamba chunk size (used by ``mamba_cache_mode='all'``)."""

    @property
    def has_attention(self) -> bool:
        """True when some layer holds attention KV."""
        return any(layer.kind != "mamba" for layer in self.layers)

    @property
    def has_mamba(self) -> bool:
        """True when some layer holds Mamba/GDN state."""
        return any(layer.kind == "mamba" for layer in self.layers)

    @property
    def is_hybrid(self) -> bool:
        """True when attention and Mamba layers coexist (pages get unified and padded)."""
        return self.has_attention and self.has_mamba


def _need(cfg: dict[str, Any], key: str, *alts: str) -> Any:
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    raise ManifestError(f"hf_config.{key}", "missing (needed to lay out the KV cache)")


def _dtype(cfg: dict[str, Any]) -> str:
    # vLLM's dtype="auto" serves float32 checkpoints in bfloat16.
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if not isinstance(raw, str):
        raise ManifestError("hf_config.torch_dtype", f"{raw!r} is not a dtype name")
    out = {"float32": "bfloat16", "float": "bfloat16", "half": "float16"}.get(raw, raw)
    if out not in DTYPE_BYTES:
        raise ManifestError("hf_config.torch_dtype", f"unknown dtype {raw!r}")
    return out


def _attention(cfg: dict[str, Any]) -> AttentionGeometry:
    heads = int(_need(cfg, "num_attention_heads"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or int(_need(cfg, "hidden_size")) // heads
    return AttentionGeometry(num_heads=heads, num_kv_heads=kv, head_size=int(head_dim))


def _mamba2(
    cfg: dict[str, Any], heads: str, head_dim: str, groups: str, state: str, conv: str
) -> MambaGeometry:
    n_heads, d_head = int(_need(cfg, heads)), int(_need(cfg, head_dim))
    return MambaGeometry(
        mamba_type="mamba2",
        conv_kernel=int(_need(cfg, conv)),
        intermediate=n_heads * d_head,
        state_size=int(_need(cfg, state)),
        num_heads=n_heads,
        head_dim=d_head,
        n_groups=int(_need(cfg, groups)),
    )


def _layers(kinds: list[LayerKind], attn_suffix: str, mamba_suffix: str) -> list[LayerSpec]:
    return [
        LayerSpec(i, f"model.layers.{i}.{mamba_suffix if k == 'mamba' else attn_suffix}", k)
        for i, k in enumerate(kinds)
    ]


def _check_count(cfg: dict[str, Any], kinds: list[Any], field: str) -> None:
    n = int(_need(cfg, "num_hidden_layers"))
    if len(kinds) != n:
        raise ManifestError(f"hf_config.{field}", f"has {len(kinds)} entries, expected {n}")


def _name(cfg: dict[str, Any], model_type: str) -> str:
    return str(cfg.get("_name_or_path") or model_type)


def _read_granite(cfg: dict[str, Any], mt: str) -> ModelGeometry:
    """GraniteMoeHybrid (``layer_types``) and Bamba (``attn_layer_indices``): mamba2."""
    n = int(_need(cfg, "num_hidden_layers"))
    if cfg.get("layer_types") is not None:
        types = list(cfg["layer_types"])
        _check_count(cfg, types, "layer_types")
        kinds: list[LayerKind] = ["mamba" if t == "mamba" else "full_attention" for t in types]
    else:
        attn = set(_need(cfg, "attn_layer_indices", "layer_types"))
        kinds = ["full_attention" if i in attn else "mamba" for i in range(n)]
    mamba = _mamba2(
        cfg, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"
    )
    expand_dim = int(_need(cfg, "mamba_expand")) * int(_need(cfg, "hidden_size"))
    if expand_dim != mamba.intermediate:
        raise ManifestError(
            "hf_config.mamba_expand",
            f"mamba_expand*hidden_size={expand_dim} != mamba_n_heads*mamba_d_head="
            f"{mamba.intermediate}",
        )
    return ModelGeometry(
        model_type=mt,
        name=_name(cfg, mt),
        dtype=_dtype(cfg),
        layers=tuple(_layers(kinds, "self_attn", "mamba")),
        attention=_attention(cfg),
        mamba=mamba,
        chunk_size=cfg.get("mamba_chunk_size") or cfg.get("chunk_size"),
    )


def _read_nemotron_h(cfg: dict[str, Any], mt: str) -> ModelGeometry:
    """NemotronH: ``hybrid_override_pattern`` M=mamba2, *=attention, -/E = MLP/MoE (no KV)."""
    pattern = str(_need(cfg, "hybrid_override_pattern"))
    _check_count(cfg, list(pattern), "hybrid_override_pattern")
    layers = [
        LayerSpec(i, f"model.layers.{i}.mixer", "mamba" if c == "M" else "full_attention")
        for i, c in enumerate(pattern)
        if c in "M*"
    ]
    return ModelGeometry(
        model_type=mt,
        name=_name(cfg, mt),
        dtype=_dtype(cfg),
        layers=tuple(layers),
        attention=_attention(cfg),
        mamba=_mamba2(
            cfg, "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"
        ),
        # vLLM's NemotronH hook: the HF value, else float32 (newer vLLM; ~v0.13-0.17 used float16).
        ssm_dtype_hint=cfg.get("mamba_ssm_cache_dtype") or "float32",
        chunk_size=cfg.get("chunk_size"),
    )


def _gdn(text: dict[str, Any]) -> MambaGeometry:
    return MambaGeometry(
        mamba_type="gdn",
        conv_kernel=int(_need(text, "linear_conv_kernel_dim")),
        num_k_heads=int(_need(text, "linear_num_key_heads")),
        num_v_heads=int(_need(text, "linear_num_value_heads")),
        head_k_dim=int(_need(text, "linear_key_head_dim")),
        head_v_dim=int(_need(text, "linear_value_head_dim")),
    )


def _read_qwen_gdn(cfg: dict[str, Any], mt: str) -> ModelGeometry:
    """Qwen3-Next / Qwen3.5: gated delta net layers with periodic full attention."""
    text = cfg.get("text_config") or cfg
    n = int(_need(text, "num_hidden_layers"))
    if text.get("layer_types") is not None:
        types = list(text["layer_types"])
        _check_count(text, types, "layer_types")
    else:
        every = int(_need(text, "full_attention_interval"))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    kinds: list[LayerKind] = ["full_attention" if t == "full_attention" else "mamba" for t in types]
    gdn = _gdn(text)
    hint = None
    if mt in ("qwen3_5", "qwen3_5_moe"):  # vLLM's Qwen3.5 hook reads text_config.mamba_ssm_dtype
        hint = text.get("mamba_ssm_dtype")
    return ModelGeometry(
        model_type=mt,
        name=_name(cfg, mt),
        dtype=_dtype(text) if ("torch_dtype" in text or "dtype" in text) else _dtype(cfg),
        layers=tuple(_layers(kinds, "self_attn", "linear_attn")),
        attention=_attention(text),
        mamba=gdn,
        ssm_dtype_hint=hint,
    )


def _mamba1(cfg: dict[str, Any]) -> MambaGeometry:
    return MambaGeometry(
        mamba_type="mamba1",
        conv_kernel=int(_need(cfg, "mamba_d_conv")),
        intermediate=int(_need(cfg, "mamba_expand")) * int(_need(cfg, "hidden_size")),
        state_size=int(_need(cfg, "mamba_d_state")),
    )


def _read_jamba(cfg: dict[str, Any], mt: str) -> ModelGeometry:
    """Jamba: attention where ``i % attn_layer_period == attn_layer_offset``, mamba1 elsewhere."""
    n = int(_need(cfg, "num_hidden_layers"))
    period, offset = int(_need(cfg, "attn_layer_period")), int(_need(cfg, "attn_layer_offset"))
    kinds: list[LayerKind] = [
        "full_attention" if i % period == offset else "mamba" for i in range(n)
    ]
    mamba = _mamba1(cfg)
    return ModelGeometry(
        model_type=mt,
        name=_name(cfg, mt),
        dtype=_dtype(cfg),
        layers=tuple(_layers(kinds, "self_attn", "mamba")),
        attention=_attention(cfg),
        mamba=mamba,
    )


def _read_falcon_h1(cfg: dict[str, Any], mt: str) -> ModelGeometry:
    """Falcon-H1: every layer runs attention and mamba2 in parallel (attention built first)."""
    n = int(_need(cfg, "num_hidden_layers"))
    layers: list[LayerSpec] = []
    for i in range(n):
        layers.append(LayerSpec(i, f"model.layers.{i}.self_attn", "full_attention"))
        layers.append(LayerSpec(i, f"model.layers.{i}.mamba", "mamba"))
    mamba = _mamba2(
        cfg, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"
    )
    d_ssm = cfg.get("mamba_d_ssm") or int(_need(cfg, "mamba_expand")) * int(
        _need(cfg, "hidden_size")
    )
    if int(d_ssm) != mamba.intermediate:
        raise ManifestError(
            "hf_config.mamba_d_ssm",
            f"{d_ssm} != mamba_n_heads*mamba_d_head={mamba.intermediate}",
        )
    return ModelGeometry(
        model_type=mt,
        name=_name(cfg, mt),
        dtype=_dtype(cfg),
        layers=tuple(layers),
        attention=_attention(cfg),
        mamba=mamba,
    )


def _read_dense(cfg: dict[str, Any], mt: str) -> ModelGeometry:
    """Pure attention; ``layer_types`` may mark ``sliding_attention`` layers (gpt-oss)."""
    n = int(_need(cfg, "num_hidden_layers"))
    types = cfg.get("layer_types")
    if types is not None:
        _check_count(cfg, list(types), "layer_types")
    elif mt == "mistral" and cfg.get("sliding_window"):
        types = ["sliding_attention"] * n
    else:
        types = ["full_attention"] * n
    kinds: list[LayerKind] = [
        "sliding_window" if t == "sliding_attention" else "full_attention" for t in types
    ]
    window = int(_need(cfg, "sliding_window")) if "sliding_window" in kinds else None
    return ModelGeometry(
        model_type=mt,
        name=_name(cfg, mt),
        dtype=_dtype(cfg),
        layers=tuple(_layers(kinds, "self_attn", "mamba")),
        attention=_attention(cfg),
        mamba=None,
        sliding_window=window,
    )


READERS: dict[str, Callable[[dict[str, Any], str], ModelGeometry]] = {
    "granitemoehybrid": _read_granite,
    "bamba": _read_granite,
    "nemotron_h": _read_nemotron_h,
    "qwen3_next": _read_qwen_gdn,
    "qwen3_5": _read_qwen_gdn,
    "qwen3_5_moe": _read_qwen_gdn,
    "jamba": _read_jamba,
    "falcon_h1": _read_falcon_h1,
    "llama": _read_dense,
    "mistral": _read_dense,
    "qwen2": _read_dense,
    "qwen3": _read_dense,
    "gpt_oss": _read_dense,
}
"""Supported ``model_type`` values and their readers."""


def read_geometry(hf_config: dict[str, Any]) -> ModelGeometry:
    """Read a HF config dict into a :class:`ModelGeometry`, or say which model_type is unknown."""
    mt = hf_config.get("model_type")
    reader = READERS.get(mt) if isinstance(mt, str) else None
    if reader is None:
        raise UnsupportedModelError(
            "hf_config.model_type",
            f"model_type {mt!r} is not supported (supported: {', '.join(sorted(READERS))}); "
            f"the planner needs: {NEEDED_FIELDS}",
        )
    try:
        geometry = reader(hf_config, mt)
    except KvxferdError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:  # a config is input
        raise ManifestError("hf_config", f"a field has a wrong type or value: {exc}") from None
    if not geometry.layers:
        raise ManifestError("hf_config.num_hidden_layers", "the model has no KV-holding layer")
    return geometry


_GRANITE_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv")
_MAMBA_READERS: dict[str, Callable[[dict[str, Any]], MambaGeometry]] = {
    "nemotron_h": lambda c: _mamba2(
        c, "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"
    ),
    "granitemoehybrid": lambda c: _mamba2(c, *_GRANITE_KEYS),
    "bamba": lambda c: _mamba2(c, *_GRANITE_KEYS),
    "falcon_h1": lambda c: _mamba2(c, *_GRANITE_KEYS),
    "jamba": _mamba1,
    "qwen3_next": lambda c: _gdn(c.get("text_config") or c),
    "qwen3_5": lambda c: _gdn(c.get("text_config") or c),
    "qwen3_5_moe": lambda c: _gdn(c.get("text_config") or c),
}


def read_mamba_geometry(hf_config: dict[str, Any]) -> MambaGeometry | None:
    """The Mamba/GDN mixer geometry alone, without the layer list (an engine's config object
    may have turned that into its own form): None for a model without a supported mixer."""
    mt = hf_config.get("model_type")
    reader = _MAMBA_READERS.get(mt) if isinstance(mt, str) else None
    return None if reader is None else reader(hf_config)
