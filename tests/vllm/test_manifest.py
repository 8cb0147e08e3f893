"""The manifest read off vLLM's own tensors addresses exactly the bytes vLLM's views do."""

import math

import msgspec
import numpy as np
import pytest
import torch

from kvxferd.layout import validate_manifest
from kvxferd.vllm.manifest import vllm_manifest
from kvxferd.wire import AttentionLayer, Part

LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
MODELS = ["dense", "nemotron-h", "qwen3-next"]


def _manifest(engine, views):
    return vllm_manifest(
        views,
        engine.kv_cache_config,
        model="m",
        tp_rank=0,
        tp_size=1,
        total_kv_heads=engine.config.model_config.get_total_num_kv_heads(),
        region_prefix="kvx-test",
    )


def _part_mask(size: int, offset: int, part: Part, units: int) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    view = np.lib.stride_tricks.as_strided(
        mask[offset + part.offset :],
        shape=(units, part.units, part.rows, part.unit_bytes),
        strides=(part.block_stride, part.unit_stride, part.row_stride, 1),
    )
    view[...] = True
    return mask


def _torch_mask(buf: torch.Tensor, fill) -> np.ndarray:
    buf.zero_()
    fill()
    return buf.numpy() != 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_every_part_covers_the_bytes_of_vllms_view(engines, model, layout):
    engine = engines(model, layout)
    from kvxferd.vllm import cpu

    views = cpu.allocate(engine, layout)
    manifest = _manifest(engine, views)
    validate_manifest(manifest)
    buf = torch.as_strided(next(iter(views.values())).view(torch.int8), (1,), (1,), 0)
    storage = next(iter(views.values())).untyped_storage()
    buf = torch.empty(0, dtype=torch.int8).set_(storage)
    size = storage.nbytes()
    groups = engine.kv_cache_config.kv_cache_groups
    assert len(manifest.groups) == len(groups)
    for g, group in enumerate(manifest.groups):
        assert group.block_size == groups[g].kv_cache_spec.block_size
        for layer in group.layers:
            region = manifest.regions[layer.region]
            units = manifest.num_blocks * (group.block_size // group.kernel_block_size)
            view = views[layer.name]
            if isinstance(layer, AttentionLayer):
                hs = layer.head_size
                parts = {
                    "k": lambda v=view, hs=hs: v[..., :hs].fill_(1.0),
                    "v": lambda v=view, hs=hs: v[..., hs:].fill_(1.0),
                }
                pairs = [(layer.k, parts["k"]), (layer.v, parts["v"])]
            else:
                conv = (
                    math.prod(layer.conv_shape)
                    * torch.tensor([], dtype=getattr(torch, layer.conv_dtype)).element_size()
                )
                ssm = layer.ssm.units * layer.ssm.unit_bytes
                pairs = [
                    (layer.conv[0], lambda v=view, c=conv: v[..., :c].fill_(1)),
                    (layer.ssm, lambda v=view, c=conv, s=ssm: v[..., c : c + s].fill_(1)),
                ]
            for part, fill in pairs:
                want = _torch_mask(buf, fill)
                got = _part_mask(size, region.source_offset, part, units)
                assert np.array_equal(got, want), (layer.name, part.name)


HYBRIDS = [("nemotron-h", 1), ("nemotron-h", 2), ("qwen3-next", 1), ("qwen3-next", 2)]


def _conv_layout(monkeypatch, layout: str) -> None:
    """VLLM_SSM_CONV_STATE_LAYOUT for what is built next (vLLM caches the value it read)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
    get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize(("model", "tp"), HYBRIDS)
def test_each_conv_section_unit_covers_its_channels_of_vllms_conv_state(
    monkeypatch, model, tp, layout
):
    """vLLM shards the conv channels x|B|C (mamba2: heads, groups) or Q|K|V (GDN: key heads,
    value heads) per rank; each unit of each section part addresses exactly those channels of
    vLLM's conv state tensor, in every row (SD) or as one run (DS)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    from kvxferd.vllm import cpu
    from kvxferd.vllm.connector import _conv_geometry
    from tests.vllm.conftest import config_dir

    _conv_layout(monkeypatch, layout)
    try:
        engine = cpu.build(config_dir(model), num_blocks=24, layout="LBHNC", tp_size=tp)
        geo = _conv_geometry(engine.config, tp)
    finally:
        monkeypatch.undo()
        get_conv_state_layout.cache_clear()
    assert geo.layout == layout and geo.sections
    views = cpu.allocate(engine, "LBHNC")
    manifest = vllm_manifest(
        views, engine.kv_cache_config, model="m", tp_rank=tp - 1, tp_size=tp,
        total_kv_heads=engine.config.model_config.get_total_num_kv_heads(), region_prefix="k",
        conv=geo,
    )  # fmt: skip
    validate_manifest(manifest)
    storage = next(iter(views.values())).untyped_storage()
    buf = torch.empty(0, dtype=torch.int8).set_(storage)
    mamba = [g for g in manifest.groups if g.kind == "mamba"]
    assert mamba
    for group in mamba:
        for layer in group.layers:
            dtype = getattr(torch, layer.conv_dtype)
            page = views[layer.name]
            conv_bytes = math.prod(layer.conv_shape) * torch.tensor([], dtype=dtype).element_size()
            region = manifest.regions[layer.region]
            channel = 0
            for part, sec in zip(layer.conv, geo.sections, strict=True):
                assert (part.name, part.sliceable) == (sec.name, True)
                assert part.rows == (layer.conv_shape[0] if layout == "SD" else 1)
                for u in range(part.units):
                    lo = channel + u * sec.unit_channels
                    hi = lo + sec.unit_channels

                    conv = page[..., :conv_bytes].view(dtype).view(-1, *layer.conv_shape)
                    cut = conv[:, :, lo:hi] if layout == "SD" else conv[:, lo:hi, :]
                    one = msgspec.structs.replace(
                        part, units=1, offset=part.offset + u * part.unit_stride
                    )
                    want = _torch_mask(buf, lambda cut=cut: cut.fill_(1))
                    got = _part_mask(
                        storage.nbytes(), region.source_offset, one, manifest.num_blocks
                    )
                    assert np.array_equal(got, want), (layer.name, part.name, u)
                channel += sec.units * sec.unit_channels


def test_a_conv_state_without_known_sections_stays_one_shard_and_refuses_another_tp(engines):
    """Sections kvxferd cannot match to vLLM's conv dim (an unknown model, a config that does
    not add up): the conv state is one unsliceable shard per rank, and a peer at another TP
    size is refused before any READ (vLLM recomputes) instead of being read wrongly."""
    from kvxferd.descriptors import read_geometry
    from kvxferd.errors import IncompatiblePeerError
    from kvxferd.layout.states import ConvSection
    from kvxferd.vllm.manifest import ConvGeometry

    wrong = ConvGeometry("SD", (ConvSection("conv_x", 3, 7, 3),))
    manifests = []
    for tp in (1, 2):
        engine = engines("nemotron-h", "LBHNC", tp_size=tp)
        views = cpu_views(engine)
        manifests.append(
            vllm_manifest(
                views,
                engine.kv_cache_config,
                model="m",
                tp_rank=0,
                tp_size=tp,
                total_kv_heads=2,
                region_prefix="w",
                conv=wrong,
            )  # fmt: skip
        )
    for m in manifests:
        conv = [p for g in m.groups if g.kind == "mamba" for la in g.layers for p in la.conv]
        assert conv and all((p.name, p.sliceable) == ("conv", False) for p in conv)
    with pytest.raises(IncompatiblePeerError, match=r"conv\[0\]"):
        read_geometry(manifests[0], manifests[1])


def cpu_views(engine):
    """vLLM's allocate_kv_cache views of ``engine`` (plain CPU memory)."""
    from kvxferd.vllm import cpu

    return cpu.allocate(engine, "LBHNC")


def test_conv_sections_follow_vllms_sharding_or_are_left_unknown():
    """x by heads, B and C by groups (the one group replicated when n_groups == 1); a split
    vLLM itself cannot make (3 groups over TP 2) or an unknown model gets no sections."""
    from kvxferd.vllm.manifest import conv_geometry

    hf = {"model_type": "nemotron_h", "mamba_num_heads": 8, "mamba_head_dim": 32,
          "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4}  # fmt: skip
    got = conv_geometry(hf, 2, "SD").sections
    assert [(s.name, s.units, s.unit_channels, s.units_total) for s in got] == [
        ("conv_x", 4, 32, 8), ("conv_b", 1, 16, 2), ("conv_c", 1, 16, 2)]  # fmt: skip
    one = conv_geometry({**hf, "n_groups": 1}, 2, "SD").sections
    assert [(s.units, s.units_total) for s in one[1:]] == [(1, 1), (1, 1)]
    assert conv_geometry({**hf, "n_groups": 3}, 2, "SD").sections == ()
    assert conv_geometry({"model_type": "llama"}, 2, "DS").sections == ()
    assert conv_geometry({"model_type": "mystery"}, 2, "DS").sections == ()
