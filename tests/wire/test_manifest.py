"""The manifest's lists are bounded at decode (regions, groups, a group's layers, a Mamba layer's
conv parts and state shapes), each refusal naming the list, and a list at its bound is taken."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.layout.planner import PlanOptions, plan_manifest
from kvxferd.layout.presets import load_hf_config, preset_names
from kvxferd.wire import (
    MAX_CONV_PARTS,
    MAX_GROUPS,
    MAX_LAYERS,
    MAX_REGIONS,
    MAX_SHAPE_DIMS,
    decode_manifest,
    encode_manifest,
)

_HYBRID = msgspec.to_builtins(plan_manifest(load_hf_config("qwen3-next-80b-a3b"), PlanOptions()))
"""A GDN hybrid: attention and Mamba groups, so every bounded list is there to lengthen."""
_MAMBA = next(i for i, g in enumerate(_HYBRID["groups"]) if g["kind"] == "mamba")

_LISTS = [
    (("regions",), MAX_REGIONS),
    (("groups",), MAX_GROUPS),
    (("groups", 0, "layers"), MAX_LAYERS),
    (("groups", _MAMBA, "layers", 0, "conv"), MAX_CONV_PARTS),
    (("groups", _MAMBA, "layers", 0, "conv_shape"), MAX_SHAPE_DIMS),
    (("groups", _MAMBA, "layers", 0, "ssm_shape"), MAX_SHAPE_DIMS),
]
_IDS = ["regions", "groups", "layers", "conv", "conv_shape", "ssm_shape"]


def _with_length(path: tuple, n: int) -> bytes:
    """The hybrid's manifest with the list at ``path`` repeating its first entry to ``n``."""
    body = msgspec.json.decode(msgspec.json.encode(_HYBRID))  # a deep copy
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = [parent[path[-1]][0]] * n
    return msgspec.json.encode(body)


def _path(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


@pytest.mark.parametrize(("path", "most"), _LISTS, ids=_IDS)
def test_a_manifest_list_past_its_bound_is_refused_and_named(path, most):
    with pytest.raises(msgspec.ValidationError) as err:
        decode_manifest(_with_length(path, most + 1))
    assert str(err.value) == f"Expected `array` of length <= {most} - at `${_path(path)}`"


@pytest.mark.parametrize(("path", "most"), _LISTS, ids=_IDS)
def test_a_manifest_list_at_its_bound_is_taken(path, most):
    manifest = decode_manifest(_with_length(path, most))
    value: object = manifest
    for key in path:
        value = value[key] if isinstance(key, int) else getattr(value, key)
    assert len(value) == most  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", preset_names())
def test_every_planned_preset_decodes_within_the_bounds(preset):
    """The real models kvxferd plans, hybrids included, are far from every bound."""
    manifest = plan_manifest(load_hf_config(preset), PlanOptions())
    assert decode_manifest(encode_manifest(manifest)) == manifest
