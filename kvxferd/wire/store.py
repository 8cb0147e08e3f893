"""The engine API's store messages (save, lookup and load of the offload tier)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvxferd.wire.engine import _FED_PER_GROUP, MAX_TOKENS, MAX_TP, BlockIdsPerGroup
from kvxferd.wire.manifest import (
    ChosenHoldId,
    NotAfterNs,
    RegistrationGeneration,
    RequestId,
    _Strict,
)

STORE_KEY_HEX = 32
"""Hex digits of a store key (a 128-bit blake2b digest, ``kvxferd.store.chunk_keys``)."""
STORE_KEY_PATTERN = rf"^[0-9a-f]{{{STORE_KEY_HEX}}}(?!\n)$"
"""A chunk key's text (kvxferd.store.keys checks keys an engine hands over with it)."""
StoreKey = Annotated[str, msgspec.Meta(max_length=STORE_KEY_HEX, pattern=STORE_KEY_PATTERN)]
"""A chunk key: 32 lowercase hex digits."""
StoreKeys = Annotated[
    list[StoreKey], msgspec.Meta(max_length=MAX_TOKENS, extra_json_schema={"uniqueItems": True})
]
"""A prompt's chunk keys: at most MAX_TOKENS (one chunk a token, the smallest chunk), all
different (a key names its whole prefix; the sidecar answers a repeat with a 422 naming it)."""
StoreRank = Annotated[int, msgspec.Meta(ge=-1, lt=MAX_TP)]
"""The TP rank whose blocks a store call means: -1 (or the rank) on a rank's own sidecar;
required on a pod sidecar (0..ranks-1), whose ranks each save and load their own blocks."""
STORE_SAVE_DEADLINE_S = 30.0
"""A sidecar copies no entry out of a save's blocks past this many seconds after the call came
(it answers what it stored by then); clients wait longer, so none is copied from blocks an engine
freed and reused after giving up on the save."""


class StoreSaveRequest(_Strict, kw_only=True):
    """Engine -> sidecar: keep a request's computed blocks in the store (issue 12)."""

    request_id: RequestId
    """The engine's request id, for logs (at most 512 characters on one line, ONE_LINE_PATTERN)."""
    keys: StoreKeys
    """Chunk keys of the prompt (``kvxferd.store.chunk_keys``, 32 hex digits each): one per
    ``store_chunk_tokens`` tokens, the last chunk possibly partial (at most MAX_TOKENS)."""
    block_ids: BlockIdsPerGroup = []
    """Logical block ids per group, in request order (mamba: the state block last); empty when
    ``hold_id`` names them. A group lists at most the blocks ``num_tokens`` span (at least 1)
    plus HOLD_SPARE_BLOCKS, as a hold's, a full-attention group at least the blocks they span
    (-1: not saved), else a 422 naming it; a shorter list (a sliding window's) holds the last."""
    num_tokens: Annotated[
        int, msgspec.Meta(extra_json_schema={"minimum": -1, "maximum": MAX_TOKENS})
    ] = -1
    """Tokens the blocks hold (the Mamba state is the state after this many; at most
    MAX_TOKENS); -1 with ``hold_id``: the hold's."""
    hold_id: ChosenHoldId = ""
    """Save the blocks of this live hold (pinned while it lasts) instead of ``block_ids``; on
    a pod, one ``tp_rank`` placed (else a 422 naming it)."""
    generation: RegistrationGeneration = None
    """The registration generation these block ids refer to; another one is a 409
    (StaleGenerationError) and nothing is saved. None: not checked."""
    tp_rank: StoreRank = -1
    """The saving rank, whose blocks are copied (required on a pod sidecar, else a 422 naming
    it: a pod hold's block ids are every rank's); -1: the sidecar's one rank."""
    not_after_ns: NotAfterNs = 0
    """The engine's monotonic clock (ns) past which it may free the blocks: a save arriving
    later is a 408 (CallExpiredError), and no entry whose copy ends later is kept. 0: no bound
    but STORE_SAVE_DEADLINE_S from arrival. The Python client sets it to the call's start plus
    STORE_SAVE_DEADLINE_S."""


class StoreSaved(_Strict, kw_only=True):
    """Sidecar -> engine: what a save stored; the blocks may be freed once this arrives."""

    chunks_saved: int
    """Entries (chunk x group) written."""
    chunks_present: int
    """Entries already in the store (not written again)."""
    chunks_skipped: int = 0
    """Entries the tokens span that were not saved for want of their blocks: -1 ids, a sliding
    window's blocks that left it, a full-attention group's chunks from its first missing block
    on, a Mamba group without a state block. Saved, present and skipped add up to every entry
    unless the save stopped early (its deadline, an unregister)."""
    kv_bytes: int = 0
    """Attention bytes copied out of the blocks."""
    state_bytes: int = 0
    """Mamba state bytes copied out of the blocks."""
    dram_bytes: int = 0
    """Entry bytes put into the DRAM tier."""
    file_bytes: int = 0
    """Entry bytes written to the file tier."""
    duration_s: float = 0.0
    """Wall time of the save."""


class StoreLookupRequest(_Strict, kw_only=True):
    """Engine -> sidecar: how much of this prompt can the store serve?"""

    keys: StoreKeys
    """Chunk keys of the prompt (at most MAX_TOKENS)."""
    num_tokens: Annotated[
        int, msgspec.Meta(extra_json_schema={"minimum": 0, "maximum": MAX_TOKENS})
    ]
    """Prompt tokens the keys cover (0..MAX_TOKENS, else a 422 naming it)."""
    tp_rank: StoreRank = -1
    """The rank asking, whose entries count (required on a pod sidecar, else a 422 naming it);
    -1: the sidecar's one rank."""


class StoreLookup(_Strict, kw_only=True):
    """Sidecar -> engine: tokens each group can serve, and the prefix all of them can."""

    matched_tokens: Annotated[list[int], _FED_PER_GROUP]
    """Per group: attention, the chunks present from the start; mamba, the end of the latest
    chunk with a saved state."""
    matched: int
    """Tokens a load can bring back: the longest prefix every group serves (a state exactly at
    its end). Less than a group's own count when groups disagree (logged, counted)."""
    disagree: bool = False
    """Whether some group's count differs from ``matched``."""


class StoreLoadRequest(_Strict, kw_only=True):
    """Engine -> sidecar: write a prompt's first tokens from the store into local blocks."""

    keys: StoreKeys
    """Chunk keys of the tokens to load (one per chunk of ``num_tokens``; at most MAX_TOKENS)."""
    block_ids: BlockIdsPerGroup
    """Local logical block ids per group (mamba: the state block last); a group lists at most
    the blocks ``num_tokens`` span (at least 1) plus HOLD_SPARE_BLOCKS, else a 422 naming it."""
    num_tokens: Annotated[
        int, msgspec.Meta(extra_json_schema={"minimum": 0, "maximum": MAX_TOKENS})
    ]
    """Tokens to load: a lookup's ``matched`` (or fewer, on a chunk boundary; at most
    MAX_TOKENS)."""
    request_id: RequestId = ""
    """The engine's request id, for logs (at most 512 characters on one line, ONE_LINE_PATTERN)."""
    deadline_s: float = 30.0
    """Past this the load stops before its next chunk and answers failed (``deadline``); the
    answer comes only once nothing more is written (a client waits a margin longer)."""
    generation: RegistrationGeneration = None
    """The registration generation these block ids refer to; another one is a 409
    (StaleGenerationError) and nothing is written. None: not checked."""
    tp_rank: StoreRank = -1
    """The loading rank, whose blocks are written with its own entries (required on a pod
    sidecar, else a 422 naming it); -1: the sidecar's one rank."""
    not_after_ns: NotAfterNs = 0
    """The engine's monotonic clock (ns) past which nothing may be written: a load arriving
    later is a 408 (CallExpiredError), and ``deadline_s`` ends there at the latest (it counts
    from the engine's call, not from a late arrival). 0: no bound but ``deadline_s``. The
    Python client sets it to the call's start plus ``deadline_s``."""


class StoreLoadStatus(_Strict, kw_only=True):
    """Sidecar -> engine: a load's end state; like PullStatus, a failed load wrote nothing valid."""

    state: Literal["done", "failed"]
    """done: every byte of ``num_tokens`` tokens is in the blocks; failed: treat them as unset."""
    reason: str = ""
    """Failure code: store_miss (an entry is not there, or went away), store_corrupt (an entry
    failed its checks and was deleted), deadline (``deadline_s`` passed), cancelled (an
    unregister stopped it), segment_too_small (the engine truncated a registered segment)."""
    detail: str = ""
    """Human-readable failure detail."""
    tokens: int = 0
    """Tokens loaded."""
    kv_bytes: int = 0
    """Attention bytes written into the blocks."""
    state_bytes: int = 0
    """Mamba state bytes written into the blocks."""
    dram_bytes: int = 0
    """Entry bytes served by the DRAM tier."""
    file_bytes: int = 0
    """Entry bytes read from the file tier."""
    dram_hit_rate: float = 0.0
    """Share of the entry bytes served by DRAM (the rest came from files)."""
    duration_s: float = 0.0
    """Wall time of the load."""
