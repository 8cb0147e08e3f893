"""The manifest read off vLLM's own tensors addresses exactly the bytes vLLM's views do."""

import math

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
