"""The KV manifest: regions, groups, layers and parts, the centre of everything."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

_POSITIVE = {"exclusiveMinimum": 0}
"""Schema-only constraints (``extra_json_schema``) document what the sidecar checks itself, so
its answer keeps naming the field with the error class it always used (HoldRequestError, ...)."""

ENGINE_ID_PATTERN = r"^[!-~]{1,128}(?!\n)$"
"""An engine id: 1-128 printable ASCII characters, no space (it goes into logs, the ready line,
NIXL agent and region names, and to peers). ``(?!\n)``: Python's ``$`` also matches before a
final newline."""
EngineId = Annotated[str, msgspec.Meta(pattern=ENGINE_ID_PATTERN)]

_LINE_BREAKERS = r"\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029"
ONE_LINE_PATTERN = rf"^[^{_LINE_BREAKERS}]*(?!\n)$"
"""Text that stays one log line: no control character but tab, ASCII or C1 (a newline would
forge a line, an escape sequence rewrite the terminal), nor U+2028/U+2029 (log viewers and
``str.splitlines`` break lines at those and at C1's NEL, U+0085). ``(?!\n)`` as in
ENGINE_ID_PATTERN."""
_LINE_BREAKER = re.compile(f"[{_LINE_BREAKERS}]")


def one_line(text: str) -> str:
    """``text`` with each character ONE_LINE_PATTERN refuses written as its Python escape
    (``\\n``, ``\\x9b``, ``\\u2028``): text from a peer, logged as it came but on one line."""
    return _LINE_BREAKER.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)


REQUEST_ID_MAX_LENGTH = 512
RequestId = Annotated[str, msgspec.Meta(max_length=REQUEST_ID_MAX_LENGTH, pattern=ONE_LINE_PATTERN)]
"""An engine's request id: at most 512 characters, one line (ONE_LINE_PATTERN). It comes from
the engine (through vLLM possibly from a client's X-Request-Id or body) and goes into logs,
tickets and feeds."""
FedRequestId = Annotated[
    str,
    msgspec.Meta(
        extra_json_schema={"maxLength": REQUEST_ID_MAX_LENGTH, "pattern": ONE_LINE_PATTERN}
    ),
]
"""A request id in a sidecar's feed: a RequestId in the schema only, so an engine reading an
older sidecar's feed is not stuck on a page with an id that sidecar let through."""

_HOLD_ID_CHAR = "[A-Za-z0-9._:-]"
HOLD_ID_MAX_LENGTH = 128
"""Longest hold id (ASCII, so as many bytes)."""
HOLD_ID_PATTERN = rf"^{_HOLD_ID_CHAR}{{1,128}}(?!\n)$"
"""A hold id: 1-128 of A-Z a-z 0-9 . _ : - (the sidecar picks 32 hex digits; an engine may
choose its own for a ticket minted ahead). ``(?!\n)`` as in ENGINE_ID_PATTERN."""
HoldId = Annotated[str, msgspec.Meta(max_length=128, pattern=HOLD_ID_PATTERN)]
ChosenHoldId = Annotated[
    str, msgspec.Meta(max_length=128, pattern=rf"^{_HOLD_ID_CHAR}{{0,128}}(?!\n)$")
]
"""A hold id an engine may leave empty (the sidecar then picks one)."""
EngineInstance = Annotated[
    str, msgspec.Meta(max_length=64, pattern=rf"^{_HOLD_ID_CHAR}{{0,64}}(?!\n)$")
]
"""An engine process's own id (0-64 of A-Z a-z 0-9 . _ : -; each process picks a new one), so
an engine can tell its registration from another engine's."""
RegistrationGeneration = int | None
"""The registration generation an engine call's block ids refer to (the ``generation`` its
register answer gave): any other, -1 included, is a 409 StaleGenerationError and the call
touches nothing; None is not checked (tools, sims)."""
NotAfterNs = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
"""When an engine call that touches the engine's memory must stop acting: the engine's
``time.monotonic_ns()`` (CLOCK_MONOTONIC, which every process of one host shares; the engine
socket is local). Past it the engine has given the call up and may reuse the blocks; 0: no
bound but the call's own deadline."""

MANIFEST_VERSION = 1
"""Bump when the manifest's meaning changes. 1: first version."""

# How long a manifest's lists may be, so no absurd count reaches the descriptor math. Refused at
# decode (a 422 naming the list, or an invalid handshake): msgpack before any entry is built, JSON
# once the list is parsed (within the body limit; msgspec counts a JSON list at its end).
MAX_GROUPS = 256
"""Most KV-cache groups, so id lists per hold, ticket, pull or store call. vLLM cuts each layer
kind into groups as large as its rarest kind: 1-10 in real models (granite-4.0-h-tiny: 10)."""
MAX_LAYERS = 1024
"""Most layers in one group: models have up to a few hundred, a drafter's included."""
MAX_REGIONS = 1024
"""Most regions, memory sources and a handshake's region bases: a region per layer slot
(per_layer) or per tensor (cross_layer), so no more than a model's layers."""
MAX_CONV_PARTS = 16
"""Most conv parts of a Mamba layer: a section each (x|B|C, q|k|v: 3) or one."""
MAX_SHAPE_DIMS = 8
"""Most dimensions of a conv or SSM state shape (2 or 3 today)."""

Dtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

MemType = Literal["DRAM", "VRAM"]
GroupKind = Literal["full_attention", "sliding_window", "mamba"]
NAME_MAX_LENGTH = 255
Name = Annotated[str, msgspec.Meta(max_length=NAME_MAX_LENGTH)]
"""A name inside a manifest (part, layer, region: a POSIX shm name is at most 255 bytes): bounded
so a manifest's size follows from its list bounds, whatever the body limit."""
MODEL_MAX_LENGTH = 1024
"""Longest ``Manifest.model`` (a model name or path; longer ones are cut by the planners)."""

HeadLayout = Literal["NHD", "HND"]
KVOrder = Literal["kv_first", "blocks_first"]
ConvLayout = Literal["SD", "DS"]
MambaType = Literal["mamba1", "mamba2", "gdn"]
PoolLayout = Literal["per_layer", "cross_layer"]


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the manifest Structs: immutable, keyword-only, typos rejected."""


class Part(_Strict, kw_only=True):
    """One piece of one layer's per-block data (K, V, a conv section, the SSM state).

    A part repeats once per block unit. Inside one block unit it holds ``units`` TP units (heads,
    head groups or channels) of ``unit_bytes`` each, ``unit_stride`` apart; when
    ``unit_stride == unit_bytes`` the part is one contiguous run of ``units * unit_bytes``.
    """

    name: Name
    """What the part is: ``k``, ``v``, ``conv``, ``conv_x``, ``conv_b``, ``conv_c``, ``ssm``..."""
    offset: int
    """Bytes from the region base to this part in block unit 0."""
    block_stride: int
    """Bytes between this part in consecutive block units."""
    units: int
    """TP units (heads, groups, channels) this rank holds in this part."""
    unit_bytes: int
    """Bytes of one TP unit in one block unit."""
    unit_stride: int
    """Bytes between consecutive TP units inside one block unit (== unit_bytes if contiguous)."""
    units_total: int
    """TP units of this part across all ranks, before any replication."""
    sliceable: bool = True
    """Whether a rank may read a subset of the units (False for NHD K/V and unsectioned conv)."""
    rows: int = 1
    """Runs per TP unit: a unit is ``rows`` runs of ``unit_bytes``, ``row_stride`` apart (vLLM
    packs K|V per token, so a head's K is one run per token; an SD conv section is one run per
    conv row); 1: one run."""
    row_stride: int = 0
    """Bytes between consecutive runs of one TP unit (unused when ``rows == 1``)."""


class AttentionLayer(_Strict, kw_only=True, tag="attention"):
    """Where one attention layer's K and V live, and their head geometry (per rank)."""

    name: Name
    """Layer name, e.g. ``model.layers.3.self_attn``."""
    index: int
    """Layer index in the model (0-based)."""
    region: int
    """Index into ``Manifest.regions`` of the pooled tensor that holds this layer."""
    num_kv_heads: int
    """KV heads this rank holds (replicated when tp_size > total heads)."""
    total_kv_heads: int
    """KV heads of the model."""
    head_size: int
    """Elements per head."""
    dtype: Dtype
    """KV cache element type."""
    head_layout: HeadLayout
    """NHD (tokens outer) or HND (heads outer; each head's tokens contiguous)."""
    kv_order: KVOrder
    """kv_first: all K blocks then all V blocks; blocks_first: per kernel block [K | V]."""
    pack_index: int = 0
    """Slot of this layer in its page when several attention layers share one (seed 000)."""
    k: Part
    """The K part."""
    v: Part
    """The V part."""
    head_size_v: int = 0
    """Elements per V head when it differs from ``head_size`` (0: the same)."""


class MambaLayer(_Strict, kw_only=True, tag="mamba"):
    """Where one Mamba/GDN layer's conv and SSM state live inside a page (unpadded)."""

    name: Name
    """Layer name, e.g. ``model.layers.0.mixer``."""
    index: int
    """Layer index in the model (0-based)."""
    region: int
    """Index into ``Manifest.regions`` of the pooled tensor that holds this layer."""
    mamba_type: MambaType
    """Which mixer: mamba1, mamba2 or gated delta net."""
    conv_shape: Annotated[list[int], msgspec.Meta(max_length=MAX_SHAPE_DIMS)]
    """Conv state shape per rank, in ``conv_layout`` order (at most MAX_SHAPE_DIMS)."""
    conv_dtype: Dtype
    """Conv state element type."""
    ssm_shape: Annotated[list[int], msgspec.Meta(max_length=MAX_SHAPE_DIMS)]
    """SSM (temporal) state shape per rank (at most MAX_SHAPE_DIMS)."""
    ssm_dtype: Dtype
    """SSM state element type."""
    conv_layout: ConvLayout
    """SD: (state_len, dim); DS: (dim, state_len), so x/B/C (or q/k/v) sections are contiguous."""
    conv: Annotated[list[Part], msgspec.Meta(max_length=MAX_CONV_PARTS)]
    """Conv parts: one per section (x, B, C / q, k, v; SD: one run per conv row), or a single
    unsliceable part when the sections are unknown (at most MAX_CONV_PARTS)."""
    ssm: Part
    """The SSM state part."""


Layer = AttentionLayer | MambaLayer


class Group(_Strict, kw_only=True):
    """One KV-cache group: layers that share a block table (one per group in the engine)."""

    kind: GroupKind
    """full_attention, sliding_window or mamba."""
    block_size: int
    """Tokens per logical block (the id the engine's block table holds)."""
    kernel_block_size: int
    """Tokens per kernel block; attention blocks split into block_size // kernel_block_size."""
    layers: Annotated[list[Layer], msgspec.Meta(max_length=MAX_LAYERS)]
    """The group's layers, ``layers[i]`` living in pooled region ``layers[i].region`` (at most
    MAX_LAYERS)."""
    sliding_window: int | None = None
    """Window in tokens, for sliding_window groups."""


class Region(_Strict, kw_only=True):
    """One pooled memory tensor, registered with NIXL once."""

    name: Name
    """Stable name; for DRAM regions the POSIX shared-memory segment name."""
    size_bytes: int
    """Bytes of the region."""
    num_blocks: int
    """Logical blocks in the region (shared block-id space of all groups)."""
    page_bytes: int
    """Bytes per logical block (the block stride of hybrid pages)."""
    mem: MemType = "DRAM"
    """DRAM (shared memory) or VRAM (CUDA IPC)."""
    device_id: int = 0
    """GPU index for VRAM; 0 for DRAM."""
    source: int = -1
    """Index into ``RegisterRequest.regions`` of the allocation this region lives in; -1: the
    source at this region's own index (one allocation per region)."""
    source_offset: int = 0
    """Bytes from the start of that allocation to this region (vLLM: one backing buffer per
    worker, many regions inside it)."""


class Manifest(_Strict, kw_only=True):
    """An engine rank's KV-cache layout: identity, pooled regions and groups."""

    model: Annotated[str, msgspec.Meta(max_length=MODEL_MAX_LENGTH)]
    """Model name or architecture (at most MODEL_MAX_LENGTH characters), informational."""
    num_blocks: int
    """Logical block ids are 0..num_blocks-1, shared by all groups (vLLM's one block pool)."""
    regions: Annotated[list[Region], msgspec.Meta(max_length=MAX_REGIONS)]
    """Pooled tensors, each registered once (at most MAX_REGIONS)."""
    groups: Annotated[list[Group], msgspec.Meta(max_length=MAX_GROUPS)]
    """KV-cache groups in engine order (at most MAX_GROUPS)."""
    tp_rank: int = 0
    """This rank's tensor-parallel index."""
    tp_size: int = 1
    """Tensor-parallel world size of the engine."""
    layout: PoolLayout = "per_layer"
    """per_layer: a tensor per layer slot; cross_layer: a tensor per page-size group (seed 001)."""
    attn_pack_size: int = 1
    """Attention layers sharing one page (seed 000)."""
    engine_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """Engine identity, set by the sidecar at registration (an EngineId, or empty)."""
    epoch: int = 0
    """Boot epoch of the engine/sidecar; a restart gets a new one."""
    version: int = MANIFEST_VERSION
    """Manifest format version."""


manifest_encoder = msgspec.json.Encoder()
manifest_decoder = msgspec.json.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    """JSON bytes of a manifest."""
    return manifest_encoder.encode(manifest)


def decode_manifest(data: bytes | str) -> Manifest:
    """Parse and type-check a manifest (raises ``msgspec.ValidationError``)."""
    return manifest_decoder.decode(data)
