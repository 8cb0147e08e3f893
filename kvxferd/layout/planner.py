"""Plan a :class:`~kvxferd.wire.Manifest` from a Hugging Face config the way vLLM lays out KV.

Steps, each a small function below: resolve dtypes, size one token of attention and one Mamba
state per rank, unify the block size so both fill the same page, pick the kernel block, bucket
layers into KV-cache groups, pool the groups' i-th layers into shared regions, place the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from kvxferd.errors import ManifestError, UnsupportedModelError
from kvxferd.layout.models import LayerKind, LayerSpec, ModelGeometry, read_geometry
from kvxferd.layout.placement import KVPacking, Placement, place_layers
from kvxferd.layout.states import MambaState, mamba_state
from kvxferd.wire import DTYPE_BYTES, MODEL_MAX_LENGTH, ConvLayout, HeadLayout, KVOrder, Manifest

_CACHE_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
}


@dataclass(frozen=True)
class PlanOptions:
    """Engine settings that change the layout (vLLM flag in brackets)."""

    tp_size: int = 1
    tp_rank: int = 0
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: auto = model dtype, fp8, fp8_e5m2...
    mamba_cache_dtype: str = "auto"  # --mamba-cache-dtype (conv state; ssm too unless set)
    mamba_ssm_cache_dtype: str = "auto"  # --mamba-ssm-cache-dtype
    num_speculative_tokens: int = 0  # extra conv rows for mamba2 / GDN
    kernel_alignment: int = 16  # the attention backend's kernel block alignment
    block_size: int | None = None  # --block-size; hybrids align to max(alignment, this)
    attn_pack_size: int = 1  # --attn-pack-size (seed 000): attention layers per page
    cross_layer: bool = False  # one region per page size, (blocks, layers, page) (seed 001)
    head_layout: HeadLayout = "HND"
    conv_layout: ConvLayout = "DS"  # VLLM_SSM_CONV_STATE_LAYOUT
    kv_packing: KVPacking = "token"  # token: vLLM 0.33 [K|V] per token; block: older K then V
    kv_order: KVOrder | None = None  # block packing only: None = kv_first dense, else blocks_first
    num_blocks: int = 64  # logical blocks in the shared pool
    mamba_cache_mode: Literal["align", "all", "none"] = "align"  # none: sized like align
    engine_id: str = ""  # goes into region names so two engines on one host never collide


@dataclass(frozen=True)
class CacheDtypes:
    """Resolved element types: attention KV, Mamba conv state, Mamba SSM state."""

    kv: str
    conv: str
    ssm: str


@dataclass(frozen=True)
class BlockGeometry:
    """The unified sizes every group shares (bytes are per layer slot, per rank)."""

    block_size: int
    kernel_block_size: int
    page_bytes: int
    mamba_bytes: int  # unpadded conv + ssm of one Mamba layer (0 without Mamba)


@dataclass(frozen=True)
class PlannedGroup:
    """A KV-cache group: ``slots[i]`` (one layer, or one attention pack) lives in region i."""

    kind: LayerKind
    slots: tuple[tuple[LayerSpec, ...], ...]


def _cache_dtype(value: str, default: str, field: str) -> str:
    if value == "auto":
        return default
    if value not in _CACHE_DTYPES:
        raise ManifestError(f"options.{field}", f"unknown cache dtype {value!r}")
    return _CACHE_DTYPES[value]


def resolve_dtypes(geom: ModelGeometry, opts: PlanOptions) -> CacheDtypes:
    """vLLM's rules: auto = model dtype; ssm follows conv unless set or hooked by the model."""
    kv = _cache_dtype(opts.kv_cache_dtype, geom.dtype, "kv_cache_dtype")
    conv = _cache_dtype(opts.mamba_cache_dtype, geom.dtype, "mamba_cache_dtype")
    ssm_default = _CACHE_DTYPES.get(geom.ssm_dtype_hint or "", conv)
    ssm = _cache_dtype(opts.mamba_ssm_cache_dtype, ssm_default, "mamba_ssm_cache_dtype")
    return CacheDtypes(kv=kv, conv=conv, ssm=ssm)


def cdiv(a: int, b: int) -> int:
    """Integer ceiling division."""
    return -(-a // b)


def local_kv_heads(total: int, tp: int) -> int:
    """KV heads per rank; replicated (one per rank) when tp exceeds the head count."""
    return max(1, total // tp)


def unify_block_size(
    attn_1tok: int, mamba_page: int, opts: PlanOptions, chunk_size: int | None
) -> int:
    """Smallest aligned block whose attention page holds one Mamba state (hybrids only).

    ``attn_1tok`` already counts the ``attn_pack_size`` layers that share one page.
    """
    align = max(opts.kernel_alignment, opts.block_size or 0)
    if opts.mamba_cache_mode == "all":
        if not chunk_size:
            raise ManifestError("hf_config.mamba_chunk_size", "needed for mamba_cache_mode=all")
        chunk = math.lcm(int(chunk_size), align)
        return chunk * cdiv(cdiv(mamba_page, attn_1tok), chunk)
    return align * cdiv(mamba_page, align * attn_1tok)


def pick_kernel_block_size(block: int, hybrid: bool, dtypes: CacheDtypes, align: int) -> int:
    """FlashAttention splits the block into {64,32,16}-token kernel blocks under fp32 state."""
    if hybrid and "float32" in (dtypes.conv, dtypes.ssm):
        for size in (64, 32, 16):
            if size % align == 0 and block % size == 0:
                return size
    return block


def block_geometry(
    geom: ModelGeometry, opts: PlanOptions, dtypes: CacheDtypes, state: MambaState | None
) -> BlockGeometry:
    """Block size, kernel block size and the page every layer slot gets."""
    attn_1tok = 0  # bytes of one token of K+V for the attention layers sharing one page
    if geom.attention is not None and geom.has_attention:
        kvh = local_kv_heads(geom.attention.num_kv_heads, opts.tp_size)
        attn_1tok = 2 * kvh * geom.attention.head_size * DTYPE_BYTES[dtypes.kv]
        attn_1tok *= opts.attn_pack_size
    mamba = 0
    if state is not None and geom.has_mamba:
        conv = state.conv_dim * state.state_len * DTYPE_BYTES[dtypes.conv]
        mamba = conv + math.prod(state.ssm_shape) * DTYPE_BYTES[dtypes.ssm]
    if geom.is_hybrid:
        block = unify_block_size(attn_1tok, mamba, opts, geom.chunk_size)
    else:
        block = opts.block_size or max(16, opts.kernel_alignment)
    if block % opts.kernel_alignment:
        raise ManifestError(
            "options.block_size",
            f"block size {block} is not a multiple of kernel_alignment {opts.kernel_alignment}",
        )
    kernel = pick_kernel_block_size(block, geom.is_hybrid, dtypes, opts.kernel_alignment)
    page = block * attn_1tok if attn_1tok else mamba  # the mamba page is padded up to this
    return BlockGeometry(block, kernel, page, mamba)


def group_layers(geom: ModelGeometry, pack: int) -> tuple[list[PlannedGroup], int]:
    """vLLM's uniform-page grouping; returns the groups and ``group_size`` (regions)."""
    buckets: dict[LayerKind, list[LayerSpec]] = {}
    for layer in geom.layers:  # bucket order = first appearance
        buckets.setdefault(layer.kind, []).append(layer)
    units: dict[LayerKind, list[tuple[LayerSpec, ...]]] = {}
    for kind, layers in buckets.items():
        n = pack if kind == "full_attention" else 1  # packs: consecutive attention layers
        units[kind] = [tuple(layers[i : i + n]) for i in range(0, len(layers), n)]
    counts = [len(u) for u in units.values()]
    group_size = min(counts)
    if max(counts) < 1.5 * min(counts):
        group_size = max(counts)
    groups: list[PlannedGroup] = []
    for kind, kind_units in units.items():
        num_groups = cdiv(len(kind_units), group_size)
        for i in range(num_groups):  # strided: group i takes units i, i+num_groups, ...
            groups.append(PlannedGroup(kind, tuple(kind_units[i::num_groups])))
    return groups, group_size


def _check_options(geom: ModelGeometry, opts: PlanOptions) -> None:
    if opts.tp_size < 1 or not 0 <= opts.tp_rank < opts.tp_size:
        raise ManifestError("options.tp_rank", f"rank {opts.tp_rank} of tp_size {opts.tp_size}")
    if opts.num_blocks < 1:
        raise ManifestError("options.num_blocks", "must be at least 1")
    if opts.attn_pack_size < 1:
        raise ManifestError("options.attn_pack_size", "must be at least 1")
    if opts.attn_pack_size > 1 and not geom.is_hybrid:
        raise ManifestError("options.attn_pack_size", "packing applies to hybrid models only")
    if opts.kv_order == "kv_first" and opts.kv_packing == "token":
        raise ManifestError("options.kv_order", "kv_first needs kv_packing='block'")
    if opts.kv_order == "kv_first" and (geom.is_hybrid or opts.cross_layer):
        raise ManifestError(
            "options.kv_order", "hybrid and cross-layer caches are always blocks_first"
        )
    choices = {
        "mamba_cache_mode": ("align", "all", "none"),
        "head_layout": ("HND", "NHD"),
        "conv_layout": ("SD", "DS"),
        "kv_order": (None, "kv_first", "blocks_first"),
        "kv_packing": ("token", "block"),
    }
    for name, allowed in choices.items():
        if getattr(opts, name) not in allowed:
            raise ManifestError(f"options.{name}", f"{getattr(opts, name)!r} not in {allowed}")
    if opts.kernel_alignment < 1 or (opts.block_size is not None and opts.block_size < 1):
        raise ManifestError("options.block_size", "block size and alignment must be positive")
    if opts.num_speculative_tokens < 0:
        raise ManifestError("options.num_speculative_tokens", "must be >= 0")
    attn = geom.attention
    if attn is not None:
        tp, kv = opts.tp_size, attn.num_kv_heads
        if attn.num_heads % tp or (kv % tp if kv >= tp else tp % kv):
            raise ManifestError(
                "options.tp_size",
                f"tp={tp} does not shard {attn.num_heads} heads / {kv} KV heads evenly",
            )


def plan_manifest(hf_config: dict[str, Any], options: PlanOptions | None = None) -> Manifest:
    """The manifest vLLM would allocate for this config and options on rank ``tp_rank``."""
    opts = options or PlanOptions()
    geom = read_geometry(hf_config)
    _check_options(geom, opts)
    dtypes = resolve_dtypes(geom, opts)
    state = (
        mamba_state(geom.mamba, opts.tp_size, opts.num_speculative_tokens) if geom.mamba else None
    )
    sizes = block_geometry(geom, opts, dtypes, state)
    groups, group_size = group_layers(geom, opts.attn_pack_size)
    if opts.cross_layer and geom.is_hybrid:
        # vLLM 0.33 puts Mamba pages at slot*page of a heads-outer (BHLNC) block: they have
        # one "head". The older block-packed reading had no such layout.
        heads_outer = opts.head_layout == "HND" and opts.tp_size > 1
        ratio = sizes.block_size // sizes.kernel_block_size
        if ratio != 1 or (heads_outer and opts.kv_packing == "block"):
            raise UnsupportedModelError(
                "options.cross_layer",
                "cross-layer hybrids need kernel block == block (and packed K|V pages for a "
                f"heads-outer layout): ratio {ratio}, {opts.head_layout}, tp {opts.tp_size}",
            )
    kv_order: KVOrder = opts.kv_order or (
        "kv_first"
        if opts.kv_packing == "block" and not (geom.is_hybrid or opts.cross_layer)
        else "blocks_first"
    )
    placement = Placement(
        geom=geom,
        kv_dtype=dtypes.kv,
        conv_dtype=dtypes.conv,
        ssm_dtype=dtypes.ssm,
        state=state,
        block_size=sizes.block_size,
        kernel_block_size=sizes.kernel_block_size,
        page_bytes=sizes.page_bytes,
        slots=group_size,
        num_blocks=opts.num_blocks,
        tp_size=opts.tp_size,
        tp_rank=opts.tp_rank,
        pack=opts.attn_pack_size,
        cross_layer=opts.cross_layer,
        head_layout=opts.head_layout,
        conv_layout=opts.conv_layout,
        kv_order=kv_order,
        engine_id=opts.engine_id,
        kv_packing=opts.kv_packing,
    )
    regions, wire_groups = place_layers(placement, [(g.kind, g.slots) for g in groups])
    return Manifest(
        model=geom.name[:MODEL_MAX_LENGTH],  # a config's _name_or_path may be a long path
        num_blocks=opts.num_blocks,
        regions=regions,
        groups=wire_groups,
        tp_rank=opts.tp_rank,
        tp_size=opts.tp_size,
        layout="cross_layer" if opts.cross_layer else "per_layer",
        attn_pack_size=opts.attn_pack_size,
        engine_id=opts.engine_id,
    )
