"""The manifest of what vLLM actually allocated, read off the tensors it hands the connector.

vLLM 0.33 gives ``register_kv_caches`` one view per layer into ONE int8 backing allocation per
worker. Attention views are ``[blocks, heads, tokens, head_size + head_size_v]`` in one of six
stride orders (layer-outer ``LB*``/``LHBNC`` or block-outer ``BL*``/``BHLNC``), K and V packed per
token; Mamba/GDN views are raw int8 ``[blocks, 1, 1, page]`` pages, conv state then SSM state; the
conv state is described per section (x|B|C, Q|K|V) from the model's config so that another TP
size can read its share.
Everything here comes from the views' offsets and strides and the kv-cache config's specs, never
from a planner, so any layout vLLM picks is described byte-exactly. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvxferd.errors import ManifestError, MemoryRegionError
from kvxferd.layout import validate_manifest
from kvxferd.layout.models import read_mamba_geometry
from kvxferd.layout.states import ConvSection, mamba_state
from kvxferd.memory import CudaIpcRegion, shm_segment
from kvxferd.wire import (
    MODEL_MAX_LENGTH,
    AttentionLayer,
    CudaRegionSpec,
    Group,
    Layer,
    MambaLayer,
    Manifest,
    Part,
    Region,
    RegionSpec,
)

_MAMBA_TYPES = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn"}
_DTYPES = {
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
}


@dataclass(frozen=True)
class Allocation:
    """The backing allocation every view points into: where it starts and how long it is."""

    base: int
    size: int


def backing_allocation(kv_caches: Mapping[str, Any]) -> Allocation:
    """The one storage all views share (ManifestError if they do not share one)."""
    if not kv_caches:
        raise ManifestError("kv_caches", "vLLM handed no KV-cache tensors")
    storages = {
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in kv_caches.values()
    }
    if len(storages) != 1:
        raise ManifestError("kv_caches", f"views point into {len(storages)} allocations, not one")
    base, size = storages.pop()
    return Allocation(base, size)


def _dtype(value: Any, field: str) -> str:
    name = _DTYPES.get(str(value))
    if name is None:
        raise ManifestError(field, f"unsupported dtype {value}")
    return name


def _index(name: str, fallback: int) -> int:
    """The layer index in the model, from a name like ``model.layers.3.self_attn.attn``."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    return int(m.group(1)) if m else fallback


def _kind(spec: Any) -> str:
    kind = type(spec).__name__
    if kind == "MambaSpec":
        return "mamba"
    if kind == "SlidingWindowSpec":
        return "sliding_window"
    if kind == "FullAttentionSpec" and getattr(spec, "sliding_window", None) is None:
        return "full_attention"
    raise ManifestError("kv_cache_groups", f"{kind} is not supported by kvxferd yet")


def _extent(view: Any) -> int:
    """Bytes from a view's first byte to one past its last."""
    es = view.element_size()
    return sum((n - 1) * st for n, st in zip(view.shape, view.stride(), strict=True)) * es + es


def _regions(
    config: Any, alloc: Allocation, views: Mapping[str, Any], name: str
) -> tuple[list[Region], dict[str, int], bool]:
    """One region per distinct byte range: a layer slot (layer-outer) or a tensor (block-outer).

    Groups overlay the same slots (a block id belongs to one group at a time), so ranges repeat
    across KVCacheTensors and are registered once.
    """
    spans: dict[tuple[int, int, int], int] = {}
    where: dict[str, int] = {}
    cross = False
    for tensor in config.kv_cache_tensors:
        blocks = config.num_blocks_of(tensor)
        span = blocks * tensor.block_stride
        layer_outer = len(tensor.layers) == 1 or tensor.layer_stride >= span
        cross = cross or not layer_outer
        if layer_outer:
            span = max([span, *(_extent(views[n]) for n in tensor.layers if n in views)])
        for i, layer in enumerate(tensor.layers):
            start = tensor.offset + (i * tensor.layer_stride if layer_outer else 0)
            key = (start, span, tensor.block_stride)
            where[layer] = spans.setdefault(key, len(spans))
    regions = []
    for (start, span, stride), r in sorted(spans.items(), key=lambda kv: kv[1]):
        if start < 0 or start + span > alloc.size:
            raise ManifestError(f"regions[{r}]", f"[{start}, {start + span}) outside allocation")
        regions.append(
            Region(
                name=f"{name}-{r}",
                size_bytes=span,
                num_blocks=config.num_blocks,
                page_bytes=stride,
                source=0,
                source_offset=start,
            )
        )
    return regions, where, cross


def _attention(name: str, pos: int, view: Any, spec: Any, off: int, total_heads: int) -> Layer:
    es = view.element_size()
    blocks, heads, tokens, width = view.shape
    sb, sh, sn, sc = (s * es for s in view.stride())
    hs, hsv = spec.head_size, spec.head_size_v
    if sc != es or width != hs + hsv or heads != spec.num_kv_heads:
        raise ManifestError(name, f"view {tuple(view.shape)} does not match {spec}")

    def part(pname: str, offset: int, size: int) -> Part:
        return Part(
            name=pname,
            offset=offset,
            block_stride=sb,
            units=heads,
            unit_bytes=size * es,
            unit_stride=sh,
            units_total=total_heads,
            rows=tokens,
            row_stride=sn,
        )

    return AttentionLayer(
        name=name,
        index=_index(name, pos),
        region=0,
        num_kv_heads=heads,
        total_kv_heads=total_heads,
        head_size=hs,
        head_size_v=0 if hsv == hs else hsv,
        dtype=_dtype(view.dtype, f"{name}.dtype"),  # type: ignore[arg-type]
        head_layout="HND" if sh > sn else "NHD",
        kv_order="blocks_first",
        k=part("k", off, hs),
        v=part("v", off + hs * es, hsv),
    )


@dataclass(frozen=True)
class ConvGeometry:
    """How vLLM lays out one rank's conv state: its layout and its sections in channel order."""

    layout: str = "SD"
    """VLLM_SSM_CONV_STATE_LAYOUT: SD = (state_len, dim), DS = (dim, state_len)."""
    sections: tuple[ConvSection, ...] = ()
    """x|B|C, Q|K|V or x as vLLM shards them; empty: unknown, the conv state is one shard."""


def conv_geometry(hf_config: Mapping[str, Any], tp_size: int, layout: str) -> ConvGeometry:
    """The conv sections of a model's Mamba/GDN layers at ``tp_size`` (vLLM shards each section
    by heads, groups or channels, as :mod:`kvxferd.layout.states` lists them). A model whose
    geometry kvxferd cannot read gets none: its conv state stays one unsliceable part."""
    try:
        geom = read_mamba_geometry(dict(hf_config))
        if geom is None:
            return ConvGeometry(layout)
        return ConvGeometry(layout, mamba_state(geom, tp_size, 0).sections)
    except (ManifestError, KeyError, TypeError, ValueError):
        return ConvGeometry(layout)


def _conv_parts(
    shape: list[int], itemsize: int, off: int, sb: int, geo: ConvGeometry, total: int
) -> list[Part]:
    """The conv state as its sections (sliceable by TP unit), else as one shard of ``total``.

    SD: every one of the ``state_len`` rows holds all channels, so a section's unit is one run
    of its channels per row, a row apart. DS: a section's units are back to back.
    """
    dim, length = (shape[1], shape[0]) if geo.layout == "SD" else (shape[0], shape[1])
    secs = geo.sections
    if not secs or sum(s.units * s.unit_channels for s in secs) != dim:
        whole = dim * length * itemsize
        return [
            Part(name="conv", offset=off, block_stride=sb, units=1, unit_bytes=whole,
                 unit_stride=whole, units_total=total, sliceable=False)
        ]  # fmt: skip
    parts, channel = [], 0
    for sec in secs:
        if geo.layout == "SD":
            unit, at, rows = sec.unit_channels * itemsize, channel * itemsize, length
        else:
            unit, at, rows = sec.unit_channels * length * itemsize, channel * length * itemsize, 1
        parts.append(
            Part(name=sec.name, offset=off + at, block_stride=sb, units=sec.units,
                 unit_bytes=unit, unit_stride=unit, units_total=sec.units_total, rows=rows,
                 row_stride=dim * itemsize if rows > 1 else 0)
        )  # fmt: skip
        channel += sec.units * sec.unit_channels
    return parts


def _mamba(name: str, pos: int, view: Any, spec: Any, off: int, tp_size: int, geo: ConvGeometry):
    if len(spec.shapes) != 2:
        raise ManifestError(name, f"{len(spec.shapes)} state tensors; kvxferd moves conv + ssm")
    sb = view.stride(0) * view.element_size()
    conv_shape, ssm_shape = (list(s) for s in spec.shapes)
    conv_dt = _dtype(spec.dtypes[0], f"{name}.conv_dtype")
    ssm_dt = _dtype(spec.dtypes[1], f"{name}.ssm_dtype")
    conv_bytes = math.prod(conv_shape) * spec.dtypes[0].itemsize
    ssm_unit = math.prod(ssm_shape[1:]) * spec.dtypes[1].itemsize
    if conv_bytes + ssm_shape[0] * ssm_unit > view.shape[-1] * view.element_size():
        raise ManifestError(name, "conv + ssm state exceed the page vLLM handed over")
    mtype = _MAMBA_TYPES.get(spec.mamba_type.name)
    if mtype is None:
        raise ManifestError(name, f"mamba type {spec.mamba_type.name} is not supported")
    replicated = getattr(spec, "tp_replicated", False)
    if replicated:  # every rank holds the whole state: one shard, read from any rank
        geo = ConvGeometry(geo.layout)
    conv = _conv_parts(
        conv_shape, spec.dtypes[0].itemsize, off, sb, geo, 1 if replicated else tp_size
    )
    return MambaLayer(
        name=name,
        index=_index(name, pos),
        region=0,
        mamba_type=mtype,  # type: ignore[arg-type]
        conv_shape=conv_shape,
        conv_dtype=conv_dt,  # type: ignore[arg-type]
        ssm_shape=ssm_shape,
        ssm_dtype=ssm_dt,  # type: ignore[arg-type]
        conv_layout=geo.layout,  # type: ignore[arg-type]
        conv=conv,
        ssm=Part(
            name="ssm",
            offset=off + conv_bytes,
            block_stride=sb,
            units=ssm_shape[0],
            unit_bytes=ssm_unit,
            unit_stride=ssm_unit,
            units_total=ssm_shape[0] * (1 if replicated else tp_size),
        ),
    )


def vllm_manifest(
    kv_caches: Mapping[str, Any],
    kv_cache_config: Any,
    *,
    model: str,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int,
    region_prefix: str,
    conv: ConvGeometry | None = None,
) -> Manifest:
    """The manifest of one worker's KV cache, from vLLM's views and kv-cache config.

    Regions point into source 0, the backing allocation (``Region.source_offset``); ``conv``
    says how Mamba/GDN conv states are laid out (default: SD, one unsliceable shard). Raises
    ManifestError naming what vLLM handed over that kvxferd cannot describe.
    """
    conv = conv or ConvGeometry()
    alloc = backing_allocation(kv_caches)
    regions, where, cross = _regions(kv_cache_config, alloc, kv_caches, region_prefix)
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        first = per_layer[group.layer_names[0]] if per_layer else spec
        kind = _kind(first)
        layers: list[Layer] = []
        kernel = first.block_size
        for pos, name in enumerate(group.layer_names):
            if name not in kv_caches:
                continue
            lspec = per_layer[name] if per_layer else spec
            view = kv_caches[name]
            r = where.get(name)
            if r is None:
                raise ManifestError(f"kv_cache_groups[{g}]", f"{name} is in no KVCacheTensor")
            off = view.data_ptr() - alloc.base - regions[r].source_offset
            if kind == "mamba":
                layer = _mamba(name, pos, view, lspec, off, tp_size, conv)
            else:
                layer = _attention(name, pos, view, lspec, off, total_kv_heads)
                kernel = view.shape[2]
            layers.append(_with_region(layer, r))
        if not layers:
            raise ManifestError(f"kv_cache_groups[{g}]", "no layer of this group on this worker")
        groups.append(
            Group(
                kind=kind,  # type: ignore[arg-type]
                block_size=first.block_size,
                kernel_block_size=kernel,
                layers=layers,
                sliding_window=first.sliding_window if kind == "sliding_window" else None,
            )
        )
    manifest = Manifest(
        model=model[:MODEL_MAX_LENGTH],  # vLLM's model may be a long local path
        num_blocks=kv_cache_config.num_blocks,
        regions=regions,
        groups=groups,
        tp_rank=tp_rank,
        tp_size=tp_size,
        layout="cross_layer" if cross else "per_layer",
    )
    validate_manifest(manifest)
    return manifest


def _with_region(layer: Layer, region: int) -> Layer:
    return msgspec.structs.replace(layer, region=region)


def shift_regions(manifest: Manifest, lead: int, mem: str, device: int) -> Manifest:
    """Region offsets counted from the mapped source's start (not the allocation's), and the
    source's memory type."""
    regions = [
        msgspec.structs.replace(r, source_offset=r.source_offset + lead, mem=mem, device_id=device)
        for r in manifest.regions
    ]
    return msgspec.structs.replace(manifest, regions=regions)


def describe(
    kv_caches: Mapping[str, Any], kv_cache_config: Any, heads: int, *, model: str, tp_rank: int,
    tp_size: int, conv: ConvGeometry | None,
) -> tuple[Manifest, Any, Any]:  # fmt: skip
    """What a worker registers for vLLM's one backing allocation: (manifest with offsets from
    its source's start, source, the CUDA IPC export or None). The export stays open while
    registered (the caller closes it)."""
    alloc = backing_allocation(kv_caches)
    first = next(iter(kv_caches.values()))
    ipc = None
    if first.is_cuda:  # GPU: the sidecar maps the allocation by CUDA IPC (untested here)
        name = f"vllm-kv-r{tp_rank}"
        ipc = CudaIpcRegion.export(first, name)
        device = first.device.index or 0
        source: Any = CudaRegionSpec(
            handle=ipc.handle.to_bytes(), size_bytes=alloc.size, device_id=device
        )
        start, mem = alloc.base, "VRAM"
    else:
        seg = shm_segment(alloc.base)
        if seg is None:
            raise MemoryRegionError(
                "the KV cache is not in a /dev/shm segment, so the sidecar cannot map it"
            )
        name, start, size = seg
        source, mem, device = RegionSpec(name=name, size_bytes=size), "DRAM", 0
    manifest = vllm_manifest(
        kv_caches, kv_cache_config, model=model, tp_rank=tp_rank, tp_size=tp_size,
        total_kv_heads=heads, region_prefix=f"{name}-r", conv=conv,
    )  # fmt: skip
    return shift_regions(manifest, alloc.base - start, mem, device), source, ipc
