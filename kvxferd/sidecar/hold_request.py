"""The block ids of a hold request, checked before the hold table keeps them: one list per group,
no longer than the request's tokens span (plus lookahead spare), ids in range, no repeats but of
the null block. Store calls share the token count's range (``check_num_tokens``) and saves and
loads the length rule (``check_id_lists``). Pure functions; the pull's counterpart is
:mod:`kvxferd.sidecar.pull_request`."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import cast

import numpy as np

from kvxferd.descriptors.geometry import check_block_ids
from kvxferd.errors import BlockIdError, HoldRequestError, KvxferdError
from kvxferd.wire import HOLD_SPARE_BLOCKS, MAX_TOKENS

NULL_BLOCK = 0
"""vLLM's null block: a placeholder in block lists, never data (it may repeat)."""


def check_num_tokens(num_tokens: int, error: Callable[[str, str], KvxferdError]) -> None:
    """``num_tokens`` lies in 0..MAX_TOKENS, else ``error("num_tokens", why)`` is raised (each
    caller keeps its own error type: HoldRequestError for holds, StoreError for store calls)."""
    if not 0 <= num_tokens <= MAX_TOKENS:
        raise error("num_tokens", f"must be 0..{MAX_TOKENS}, got {num_tokens}")


def check_hold_rank(tp_rank: int, own_rank: int) -> None:
    """A hold placed on a one-rank sidecar names its rank or -1 (``tp_rank`` is a pod's field:
    another rank's hold would be placed, and ticketed, as this one's); HoldRequestError."""
    if tp_rank not in (-1, own_rank):
        raise HoldRequestError("tp_rank", f"{tp_rank}, but this sidecar's engine is rank "
                               f"{own_rank} (-1 or its own rank)")  # fmt: skip


def most_hold_ids(block_size: int, num_tokens: int) -> int:
    """Most ids a hold of ``num_tokens`` tokens may list for a group of ``block_size``-token
    logical blocks: those the tokens span (at least one, a Mamba state block), plus
    HOLD_SPARE_BLOCKS."""
    return max(1, -(-num_tokens // block_size)) + HOLD_SPARE_BLOCKS


def check_id_lists(block_sizes: tuple[int, ...], num_tokens: int, block_ids: object) -> list[Sized]:
    """One id list per group, each no longer than ``most_hold_ids``, checked before any id is
    looked at (a flood of null blocks costs nothing); the lists. BlockIdError names the entry."""
    try:
        groups = list(block_ids)  # type: ignore[call-overload]
    except TypeError:
        raise BlockIdError("block_ids", "expected one list of block ids per group") from None
    if len(groups) != len(block_sizes):
        raise BlockIdError(
            "block_ids", f"{len(groups)} id lists for {len(block_sizes)} groups (one per group)"
        )
    for g, (ids, block_size) in enumerate(zip(groups, block_sizes, strict=True)):
        most = most_hold_ids(block_size, num_tokens)
        if not isinstance(ids, Sized):
            raise BlockIdError(f"block_ids[{g}]", "expected a list of block ids")
        if len(ids) > most:
            raise BlockIdError(
                f"block_ids[{g}]", f"{len(ids)} ids; {num_tokens} tokens in blocks of "
                f"{block_size} need at most {most} ({HOLD_SPARE_BLOCKS} spare for lookahead)",
            )  # fmt: skip
    return groups


def check_hold_ids(
    num_blocks: int, block_sizes: tuple[int, ...], num_tokens: int, block_ids: object
) -> None:
    """``check_id_lists``, then ids in range, no repeats except of the null block (a
    placeholder); BlockIdError names the entry."""
    groups = check_id_lists(block_sizes, num_tokens, block_ids)
    for g, ids in enumerate(groups):
        field_ = f"block_ids[{g}]"
        arr = np.asarray(ids)
        nulls = arr.ndim == 1 and arr.dtype.kind in "iu" and bool((arr == NULL_BLOCK).any())
        if not nulls:
            check_block_ids(num_blocks, ids, field_)
            continue
        bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
        if bad.size:
            k = int(bad[0])
            raise BlockIdError(f"{field_}[{k}]", f"id {int(arr[k])} outside [0, {num_blocks})")
        _check_repeats(arr, arr != NULL_BLOCK, field_)


def check_store_ids(num_blocks: int, block_sizes: tuple[int, ...], num_tokens: int,
                    block_ids: object) -> None:  # fmt: skip
    """A save's or load's lists: ``check_id_lists``, then ids in ``[-1, num_blocks)`` (-1 skips
    a block; msgpack carries ids up to 2**64-1) and no repeats but of -1 and the null block (one
    block saved under two chunks' keys, or two chunks loaded into one); BlockIdError names it."""
    for g, ids in enumerate(check_id_lists(block_sizes, num_tokens, block_ids)):
        arr = np.asarray(ids)
        if arr.size and arr.dtype.kind != "i":  # uint64 or float64: an id past int64 in it
            seq = cast(list[int], ids)
            k = next(k for k, b in enumerate(seq) if not -1 <= b < num_blocks)
            raise BlockIdError(f"block_ids[{g}][{k}]", f"{seq[k]} outside [-1, {num_blocks})")
        bad = np.flatnonzero((arr < -1) | (arr >= num_blocks))
        if bad.size:
            k = int(bad[0])
            raise BlockIdError(f"block_ids[{g}][{k}]", f"{int(arr[k])} outside [-1, {num_blocks})")
        _check_repeats(arr, arr > NULL_BLOCK, f"block_ids[{g}]")


def _check_repeats(arr: np.ndarray, real: np.ndarray, field_: str) -> None:
    """BlockIdError naming the first entry of ``arr`` (ids in range) that repeats an earlier
    one, among the entries ``real`` marks (placeholders may repeat)."""
    data = np.flatnonzero(real)  # positions of real blocks
    order = np.argsort(arr[data], kind="stable")
    srt = arr[data][order]
    rep = np.flatnonzero(srt[1:] == srt[:-1])
    if rep.size:
        k = int(data[order[rep + 1]].min())
        first = int(np.flatnonzero(arr == arr[k])[0])
        raise BlockIdError(f"{field_}[{k}]", f"id {int(arr[k])} repeats {field_}[{first}]")
