"""Per-rank Mamba/GDN state shapes, as vLLM's MambaStateShapeCalculator computes them.

Besides the shapes, each state lists its conv *sections* (x|B|C for mamba2, Q|K|V for GDN, x for
mamba1): the channel runs that stay contiguous in the DS conv layout and that a rank of another
TP size slices by heads, groups or channels.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.errors import ManifestError
from kvxferd.layout.models import MambaGeometry


@dataclass(frozen=True)
class ConvSection:
    """A run of conv channels on one rank: ``units`` TP units of ``unit_channels`` each."""

    name: str
    units: int
    unit_channels: int
    units_total: int


@dataclass(frozen=True)
class MambaState:
    """One layer's state on one rank: conv ``(state_len, dim)`` in SD terms, and the SSM state."""

    conv_dim: int
    state_len: int
    ssm_shape: tuple[int, ...]
    ssm_units: int
    ssm_units_total: int
    sections: tuple[ConvSection, ...]

    def conv_shape(self, layout: str) -> list[int]:
        """Conv shape in ``layout`` order: SD = (state_len, dim), DS = (dim, state_len)."""
        if layout == "SD":
            return [self.state_len, self.conv_dim]
        return [self.conv_dim, self.state_len]


def _divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ManifestError("options.tp_size", f"{what}={total} is not divisible by tp={tp}")
    return total // tp


def mamba_state(geom: MambaGeometry, tp: int, num_spec: int) -> MambaState:
    """The per-rank state of one layer; ``num_spec`` extra conv rows for mamba2 and GDN."""
    if geom.mamba_type == "mamba1":
        ch = _divide(geom.intermediate, tp, "mamba intermediate size")
        return MambaState(
            conv_dim=ch,
            state_len=geom.conv_kernel - 1,
            ssm_shape=(ch, geom.state_size),
            ssm_units=ch,
            ssm_units_total=geom.intermediate,
            sections=(ConvSection("conv_x", ch, 1, geom.intermediate),),
        )
    if geom.mamba_type == "mamba2":
        heads = _divide(geom.num_heads, tp, "mamba num_heads")
        # Groups are replicated up to tp so that every head shard has its B/C group.
        groups = geom.n_groups
        if groups % tp:
            if groups > tp:
                raise ManifestError(
                    "options.tp_size", f"mamba n_groups={groups} cannot be sharded over tp={tp}"
                )
            groups = tp
        local_groups = groups // tp
        bc = local_groups * geom.state_size
        return MambaState(
            conv_dim=heads * geom.head_dim + 2 * bc,
            state_len=geom.conv_kernel - 1 + num_spec,
            ssm_shape=(heads, geom.head_dim, geom.state_size),
            ssm_units=heads,
            ssm_units_total=geom.num_heads,
            sections=(
                ConvSection("conv_x", heads, geom.head_dim, geom.num_heads),
                ConvSection("conv_b", local_groups, geom.state_size, geom.n_groups),
                ConvSection("conv_c", local_groups, geom.state_size, geom.n_groups),
            ),
        )
    k_heads = _divide(geom.num_k_heads, tp, "linear_num_key_heads")
    v_heads = _divide(geom.num_v_heads, tp, "linear_num_value_heads")
    return MambaState(
        conv_dim=2 * k_heads * geom.head_k_dim + v_heads * geom.head_v_dim,
        state_len=geom.conv_kernel - 1 + num_spec,
        ssm_shape=(v_heads, geom.head_v_dim, geom.head_k_dim),
        ssm_units=v_heads,
        ssm_units_total=geom.num_v_heads,
        sections=(
            ConvSection("conv_q", k_heads, geom.head_k_dim, geom.num_k_heads),
            ConvSection("conv_k", k_heads, geom.head_k_dim, geom.num_k_heads),
            ConvSection("conv_v", v_heads, geom.head_v_dim, geom.num_v_heads),
        ),
    )
