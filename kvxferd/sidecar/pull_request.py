"""A PullRequest checked against the local manifest, and what it asks of each prefill rank.

``check_reader_tp`` checks the decode TP size a claim announces; ``validate_pull`` is the one
place a pull's block ids and tickets are checked (a 422 naming the field: one ticket per prefill
rank, or a pod sidecar's one ticket for all); ``unread_ranks`` gives the prefill ranks no decode
rank reads from.
"""

from __future__ import annotations

import math

from kvxferd import descriptors
from kvxferd.descriptors.geometry import iter_parts
from kvxferd.errors import BlockIdError, HoldRequestError
from kvxferd.wire import MAX_TP, Group, Manifest, PullRequest

_MAX_ID = (1 << 63) - 1
"""Largest block id a plan takes (int64); a ticket's larger one is no pool's."""


def check_reader_tp(manifest: Manifest, reader_tp_size: int) -> None:
    """HoldRequestError (422, ``reader_tp_size``) unless it is a TP size the manifest's units
    can be split over or replicated to (the ownership rule), at most MAX_TP."""
    tp = reader_tp_size
    if not (isinstance(tp, int) and 1 <= tp <= MAX_TP):
        raise HoldRequestError("reader_tp_size", f"must be 1..{MAX_TP}, got {tp!r}")
    for _g, _i, name, _layer, part in iter_parts(manifest):
        ut = part.units_total
        if ut % tp and tp % ut:
            raise HoldRequestError(
                "reader_tp_size", f"{tp} neither divides nor is a multiple of the {ut} units of "
                f"part {name}",
            )  # fmt: skip


class ReaderCounts:
    """``check_reader_tp`` and ``expected_readers`` once per (registration, reader TP): both walk
    every part of the manifest and depend on nothing else (a claim's hot path)."""

    KEEP = 64
    """(registration, reader TP) pairs kept; the table is cleared past it."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], tuple[Manifest, int]] = {}

    def expected(self, manifest: Manifest, reader_tp_size: int, pod: bool = False) -> int:
        """Readers a hold of ``manifest`` expects from a decode of ``reader_tp_size`` ranks
        (HoldRequestError if that TP size cannot read it); ``pod``: a pod sidecar's hold, which
        every decode rank reads (some rank of it) once."""
        key = (id(manifest), reader_tp_size)
        hit = self._seen.get(key)
        if hit is not None and hit[0] is manifest:
            return reader_tp_size if pod else hit[1]
        check_reader_tp(manifest, reader_tp_size)  # raises: nothing cached
        readers = descriptors.expected_readers(manifest, reader_tp_size)
        if len(self._seen) >= self.KEEP:
            self._seen.clear()
        self._seen[key] = (manifest, readers)
        return reader_tp_size if pod else readers


def unread_ranks(local: Manifest, remote_tp: int) -> list[int]:
    """Prefill ranks no decode rank reads from (every unit they hold is read from a replica).

    Non-empty only when units are replicated on the prefill side (TP > KV heads). Decode rank 0
    alone answers for them, so each gets exactly one notification; the other ranks return [].
    """
    if local.tp_rank != 0:
        return []
    # Ownership only depends on units_total and tp, so this rank's parts stand in for all.
    totals = descriptors.unit_totals(local)
    read: set[int] = set()
    for rank in range(local.tp_size):
        read.update(descriptors.ranks_read(totals, local.tp_size, rank, remote_tp))
    return [r for r in range(remote_tp) if r not in read]


def most_ids(group: Group, num_tokens: int, ticket_ids: list[int] | None) -> int:
    """Most local ids a pull of ``num_tokens`` tokens may list for ``group``: the logical blocks
    the tokens span (at least one, a Mamba state block), or the ticket's list where the groups
    pair up (equal block sizes pair ids one to one, and a prefill may hold a block past the
    tokens asked for: partial prefill, lookahead). More are never read, and a flood of -1
    would cost memory and a long check."""
    spanned = -(-num_tokens // group.block_size)  # ids are logical blocks, not kernel blocks
    return max(1, spanned, len(ticket_ids) if ticket_ids is not None else 0)


def validate_pull(req: PullRequest, local: Manifest, max_deadline_s: float = math.inf) -> None:
    """Shape checks an engine gets back as a 422 naming the field; ``deadline_s`` must be at
    most ``max_deadline_s``."""
    if not req.tickets:
        raise BlockIdError("tickets", "at least one ticket is needed")
    tp = req.tickets[0].tp_size
    for i, t in enumerate(req.tickets):
        if t.ranks != 1 and (t.ranks != t.tp_size or len(req.tickets) != 1):
            raise BlockIdError(
                f"tickets[{i}].ranks", f"{t.ranks}: a pod sidecar's ticket spans all {t.tp_size} "
                "ranks and is the pull's only ticket (else 1)",
            )  # fmt: skip
        if t.tp_size != tp or t.tp_rank != i:
            raise BlockIdError(
                f"tickets[{i}]", f"expected rank {i} of {tp}, got rank {t.tp_rank} of {t.tp_size}"
            )
        if t.block_ids != req.tickets[0].block_ids:
            raise BlockIdError(f"tickets[{i}].block_ids", "differs from tickets[0].block_ids")
        # Every rank holds the same request; another's ticket (its own MAC valid) would claim
        # that request's hold and read its KV here, planned by ticket 0's tokens.
        for name in ("request_id", "num_tokens"):
            if getattr(t, name) != getattr(req.tickets[0], name):
                raise BlockIdError(f"tickets[{i}].{name}", f"differs from tickets[0].{name}")
    if len(req.tickets) * req.tickets[0].ranks != tp:
        raise BlockIdError("tickets", f"{len(req.tickets)} tickets for prefill TP {tp}")
    remote = req.tickets[0].block_ids
    for g, ids in enumerate(remote):  # a hold's ids: >= 0; msgpack carries up to 2**64-1
        if ids and (min(ids) < 0 or max(ids) > _MAX_ID):
            k = next(k for k, b in enumerate(ids) if not 0 <= b <= _MAX_ID)
            raise BlockIdError(f"tickets[0].block_ids[{g}][{k}]", f"{ids[k]} is no block id")
    if len(req.block_ids) != len(local.groups):
        raise BlockIdError(
            "block_ids", f"{len(req.block_ids)} groups given, the manifest has {len(local.groups)}"
        )
    if not -1 <= req.num_tokens <= req.tickets[0].num_tokens:
        raise BlockIdError(
            "num_tokens", f"{req.num_tokens} outside 0..{req.tickets[0].num_tokens} (or -1)"
        )
    # With a token count, ids map by token where the prefill's block sizes or grouping differ:
    # the ticket's ids are then checked against its manifest when the plan is made.
    by_tokens = req.num_tokens != -1
    if len(remote) != len(local.groups) and not by_tokens:
        raise BlockIdError(
            "tickets[0].block_ids",
            f"{len(remote)} groups in the ticket, the manifest has {len(local.groups)}",
        )
    paired = len(remote) == len(local.groups)
    for g, lo in enumerate(req.block_ids):
        if not by_tokens and len(lo) != len(remote[g]):
            raise BlockIdError(
                f"block_ids[{g}]", f"{len(lo)} local ids for {len(remote[g])} ticket ids"
            )
        if by_tokens:  # checked before the ids, so a flood of -1 costs nothing
            group = local.groups[g]
            most = most_ids(group, req.num_tokens, remote[g] if paired else None)
            if len(lo) > most:
                raise BlockIdError(
                    f"block_ids[{g}]",
                    f"{len(lo)} local ids; {req.num_tokens} tokens in blocks of "
                    f"{group.block_size} (or the ticket's list) need at most {most}",
                )
        seen: dict[int, int] = {}
        for k, b in enumerate(lo):
            if b < -1 or b >= local.num_blocks:
                raise BlockIdError(
                    f"block_ids[{g}][{k}]", f"{b} is outside 0..{local.num_blocks - 1} (or -1)"
                )
            if b >= 0 and seen.setdefault(b, k) != k:  # checked here once, not per rank
                raise BlockIdError(
                    f"block_ids[{g}][{k}]", f"id {b} repeats block_ids[{g}][{seen[b]}]"
                )
    if not (math.isfinite(req.deadline_s) and req.deadline_s > 0):  # NaN/inf come in msgpack
        raise BlockIdError("deadline_s", f"must be a finite number > 0, got {req.deadline_s!r}")
    if req.deadline_s > max_deadline_s:
        raise BlockIdError(
            "deadline_s", f"{req.deadline_s:g} s is longer than the {max_deadline_s:g} s allowed"
        )
