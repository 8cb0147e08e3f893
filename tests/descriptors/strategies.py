"""Hypothesis strategies: random model specs (see :mod:`.layouts`) and block-id requests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .layouts import DTYPES, AttnSpec, MambaSpec, ModelSpec


def _units(min_units: int) -> st.SearchStrategy[int]:
    return st.sampled_from([u for u in (1, 2, 4, 8) if u >= min_units])


@st.composite
def attn_specs(draw, min_units: int = 1, head_layout: str | None = None) -> AttnSpec:
    return AttnSpec(
        total_heads=draw(_units(min_units)),
        head_size=draw(st.sampled_from([1, 2, 4])),
        dtype=draw(st.sampled_from(DTYPES)),
        kbs=draw(st.integers(1, 2)),
        ratio=draw(st.integers(1, 4)),
        head_layout=head_layout or draw(st.sampled_from(["HND", "NHD"])),
    )


@st.composite
def mamba_specs(draw, min_units: int = 1, conv_layout: str | None = None) -> MambaSpec:
    kind = draw(st.sampled_from(["mamba1", "mamba2", "gdn"]))
    layout = conv_layout or draw(st.sampled_from(["DS", "SD"]))
    heads, groups = draw(_units(min_units)), draw(_units(min_units))
    x_ch = draw(st.integers(1, 2))
    # SD conv is one part sharded like x: other sections scale with x's units so it divides.
    mult = heads if layout == "SD" else 1
    bc_ch = mult * draw(st.integers(1, 2))
    if kind == "mamba1":
        sections = (("conv_x", heads, x_ch),)
    elif kind == "mamba2":
        sections = (("conv_x", heads, x_ch), ("conv_b", groups, bc_ch), ("conv_c", groups, bc_ch))
    else:
        sections = (("conv_q", groups, bc_ch), ("conv_k", groups, bc_ch), ("conv_v", heads, x_ch))
        if layout == "SD":  # keep the sharded section first
            sections = (sections[2], sections[0], sections[1])
    return MambaSpec(
        mamba_type=kind,
        conv_layout=layout,
        sections=sections,
        conv_rows=draw(st.integers(1, 3)),
        conv_dtype=draw(st.sampled_from(DTYPES)),
        ssm_units_total=heads,
        ssm_unit_elems=draw(st.integers(1, 4)),
        ssm_dtype=draw(st.sampled_from(DTYPES)),
        ssm_gap=draw(st.sampled_from([0, 0, 0, 1, 3])),
    )


@st.composite
def model_specs(
    draw,
    *,
    min_units: int = 1,
    head_layout: str | None = None,
    conv_layout: str | None = None,
    max_blocks: int = 64,
) -> ModelSpec:
    """Hybrid, dense or pure-mamba models; ``min_units`` bounds every part's units_total."""
    kind = draw(st.sampled_from(["hybrid", "hybrid", "dense", "mamba"]))
    attn = None if kind == "mamba" else draw(attn_specs(min_units, head_layout))
    mamba = None if kind == "dense" else draw(mamba_specs(min_units, conv_layout))
    pack = draw(st.integers(1, 3)) if kind != "mamba" else 1
    attn_groups: tuple[int, ...] = ()
    if attn:
        attn_groups = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    mamba_groups: tuple[int, ...] = ()
    if mamba:
        mamba_groups = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    return ModelSpec(
        attn=attn,
        attn_groups=attn_groups,
        pack=pack,
        kv_order=draw(st.sampled_from(["kv_first", "blocks_first"])) if kind == "dense" else
        "blocks_first",
        mamba=mamba,
        mamba_groups=mamba_groups,
        pad=draw(st.sampled_from([0, 0, 5, 64])),
        num_blocks=draw(st.integers(2, max_blocks)),
    )  # fmt: skip


@st.composite
def request_ids(
    draw, n_groups: int, num_blocks: int, max_ids: int = 12, min_ids: int = 0
) -> list[np.ndarray]:
    """Disjoint logical ids per group (one block pool: a block belongs to one group at a time)."""
    perm = draw(st.permutations(range(num_blocks)))
    counts = [draw(st.integers(min_ids, max_ids)) for _ in range(n_groups)]
    out, start = [], 0
    for c in counts:
        c = min(c, num_blocks - start)
        out.append(np.asarray(perm[start : start + c], dtype=np.int64))
        start += c
    return out


@st.composite
def paired_ids(
    draw, n_groups: int, local_blocks: int, remote_blocks: int, max_ids: int = 12, min_ids: int = 0
):
    """(local ids, remote ids) with matching counts per group, each side disjoint."""
    local = draw(request_ids(n_groups, local_blocks, max_ids, min_ids))
    rperm = draw(st.permutations(range(remote_blocks)))
    remote, start = [], 0
    for ids in local:
        c = min(ids.size, remote_blocks - start)
        remote.append(np.asarray(rperm[start : start + c], dtype=np.int64))
        start += c
    local = [ids[: r.size] for ids, r in zip(local, remote, strict=True)]
    return local, remote
