"""The bookkeeping of a pod sidecar (``serve --pod-ranks N``): one sidecar, one NIXL agent and one
ticket per request for all N TP ranks of an engine.

:class:`PodSlots` keeps a slot per rank while the pod forms: each worker's register reserves its
rank's slot (its manifest must agree with the ranks already there on everything but the rank and
the regions' per-rank names, devices and places in their allocations), maps its memory, fills the
slot and waits for the others; the register that fills the last slot completes the pod, and every
rank's answer carries the pod's one generation (:meth:`PodSlots.round`). :class:`PodPlacements`
keeps the holds some ranks placed and others not yet: a hold is claimable only once every rank
placed it (with the same block ids, tokens and request), and every rank is answered the same
signed ticket. A hold that cannot be read whole is given up on every rank at once (see
:meth:`Pod.place`). Pure bookkeeping on the sidecar's loop; the Sidecar maps and releases memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxferd.errors import (
    DuplicateHoldError,
    HoldRequestError,
    KvxferdError,
    ManifestError,
    NotRegisteredError,
    PodConflictError,
    RegisterInProgressError,
    StoreError,
    UnknownHoldError,
)
from kvxferd.sidecar.placements import Placements
from kvxferd.sidecar.sources import drop_sources, host_views, map_sources
from kvxferd.transport import Agent
from kvxferd.wire import (
    HoldRequest,
    Manifest,
    RankLayout,
    RegisterRequest,
    RegisterResponse,
    Ticket,
)

PER_RANK_REGION_FIELDS = ("name", "device_id", "source", "source_offset")
"""Region fields that may differ between a pod's ranks: each rank's memory is its own (its
segment names, its GPU, where its regions lie in its allocations); a reader uses each rank's own
region bases. Everything else (sizes, blocks, page bytes, memory kind, the groups) must agree."""


def _shape(manifest: Manifest) -> dict[str, Any]:
    """The manifest as builtins, less what may differ per rank (and what the sidecar sets)."""
    out = msgspec.to_builtins(manifest)
    for name in ("tp_rank", "engine_id", "epoch"):
        out.pop(name, None)
    for region in out["regions"]:
        for name in PER_RANK_REGION_FIELDS:
            region.pop(name, None)
    return out


def first_difference(a: object, b: object, path: str = "manifest") -> str | None:
    """The path of the first field where two builtin values differ (None: equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            if key not in a or key not in b:
                return f"{path}.{key}"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else path


@dataclass
class RankMemory:
    """One rank's registered memory: what ``sources.map_sources`` gave for its register."""

    manifest: Manifest
    regions: list[Any]
    registrations: list[Any]
    bases: list[int]
    sources: list[int]
    instance: str = ""


@dataclass(eq=False)
class Slot:
    """One rank's slot: the manifest and what else its register named (``key``: its regions
    and instance), its memory once mapped, and how many register calls of it wait."""

    manifest: Manifest
    key: object = None
    memory: RankMemory | None = None
    calls: int = 0


class PodSlots:
    """The N ranks' registrations: reserved by a register, filled once its memory is mapped."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._slots: list[Slot | None] = [None] * ranks
        self._round: asyncio.Future[Any] | None = None

    @property
    def _memory(self) -> list[RankMemory | None]:
        return [s.memory if s is not None else None for s in self._slots]

    @property
    def complete(self) -> bool:
        """Every rank's memory is mapped and registered."""
        return all(m is not None for m in self._memory)

    @property
    def missing(self) -> list[int]:
        """Ranks whose memory is not registered (yet)."""
        return [r for r, m in enumerate(self._memory) if m is None]

    def memory(self) -> list[RankMemory]:
        """Every rank's memory, rank order (only once complete)."""
        assert self.complete
        return [m for m in self._memory if m is not None]

    def slot(self, rank: int) -> Slot:
        """A reserved rank's slot."""
        slot = self._slots[rank]
        assert slot is not None
        return slot

    def repeats(self, manifest: Manifest, key: object) -> bool:
        """Whether ``manifest.tp_rank``'s slot holds this very register (the same manifest and
        ``key``: a worker's retry after its call got no answer), mapped already;
        RegisterInProgressError (409, transient) while the first call still maps its memory."""
        rank = manifest.tp_rank
        slot = self._slots[rank] if 0 <= rank < self.ranks else None
        if slot is None or slot.manifest != manifest or slot.key != key:
            return False
        if slot.memory is None:
            raise RegisterInProgressError(f"register: rank {rank}'s earlier register of this "
                                          "memory is still mapping it; retry")  # fmt: skip
        return True

    def joined(self) -> RankMemory:
        """A complete pod's memory as one registration: rank 0's manifest, bases, sources and
        instance, every rank's regions and NIXL registrations."""
        ranks = self.memory()
        return RankMemory(
            manifest=ranks[0].manifest,
            regions=[r for m in ranks for r in m.regions],
            registrations=[x for m in ranks for x in m.registrations],
            bases=ranks[0].bases,
            sources=ranks[0].sources,
            instance=ranks[0].instance,
        )

    def round(self) -> asyncio.Future[Any]:
        """The answer every rank of the forming pod gets (set by the register that completes
        it); a new one once the pod is cleared."""
        if self._round is None or (self._round.done() and not self.complete):
            self._round = asyncio.get_running_loop().create_future()
        return self._round

    def reserve(self, manifest: Manifest, key: object = None) -> int:
        """Take ``manifest.tp_rank``'s slot (validated manifest; ``key``: what else a repeat
        must name alike): ManifestError (422) unless its ``tp_size`` is the pod's,
        PodConflictError (409) naming ``manifest.tp_rank`` when the slot is taken or the first
        field on which it disagrees with a rank already there."""
        if manifest.tp_size != self.ranks:
            raise ManifestError("manifest.tp_size", f"{manifest.tp_size}, but this pod sidecar "
                                f"serves {self.ranks} ranks (--pod-ranks)")  # fmt: skip
        rank = manifest.tp_rank
        if not 0 <= rank < self.ranks:
            raise ManifestError("manifest.tp_rank", f"{rank} is not in 0..{self.ranks - 1}")
        if self._slots[rank] is not None:
            raise PodConflictError("manifest.tp_rank", f"rank {rank} of the pod is registered "
                                   "(or registering) already, with other memory or another "
                                   "instance")  # fmt: skip
        ours = _shape(manifest)
        for other, theirs in enumerate(self._slots):
            if theirs is not None:
                diff = first_difference(_shape(theirs.manifest), ours)
                if diff:
                    raise PodConflictError(diff, f"differs from rank {other}'s manifest (a pod's "
                                           "ranks must agree on all but their rank)")  # fmt: skip
                break
        self._slots[rank] = Slot(manifest, key)
        return rank

    def fill(self, memory: RankMemory) -> bool:
        """Put a reserved rank's mapped memory in its slot; True when that completed the pod."""
        slot = self._slots[memory.manifest.tp_rank]
        assert slot is not None and slot.memory is None
        slot.memory = memory
        return self.complete

    def vacate(self, rank: int) -> RankMemory | None:
        """Give up ``rank``'s slot (a register that failed or timed out): its memory, if mapped
        (the caller releases it)."""
        slot, self._slots[rank] = self._slots[rank], None
        return slot.memory if slot is not None else None

    def leave(self, slot: Slot) -> RankMemory | None:
        """A register call waiting on ``slot`` failed or gave up: the last one to leave an
        incomplete pod's slot vacates it (its memory returned: the caller releases it); a
        slot the pod no longer has (cleared meanwhile) is left alone."""
        slot.calls -= 1
        rank = slot.manifest.tp_rank
        if slot.calls > 0 or self._slots[rank] is not slot or self.complete:
            return None
        return self.vacate(rank)

    def clear(self) -> list[RankMemory]:
        """Empty every slot (the pod unregistered, or the sidecar closes): the memory that was
        in them (the caller releases it)."""
        out = [m for m in self._memory if m is not None]
        self._slots = [None] * self.ranks
        self._round = None
        return out

    def layouts(self, engine_id: str, epoch: int) -> list[RankLayout]:
        """Ranks 1 up of a complete pod, as a handshake names them (``Handshake.pod``)."""
        return [
            RankLayout(manifest=msgspec.structs.replace(m.manifest, engine_id=engine_id,
                                                        epoch=epoch), region_bases=m.bases)
            for m in self.memory()[1:]
        ]  # fmt: skip


@dataclass
class _Partial:
    """A hold some of the pod's ranks placed: its terms, who placed it, the ticket they got."""

    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    ticket: Ticket
    ranks: set[int] = field(default_factory=set)


class PodPlacements:
    """Holds placed by some ranks of the pod but not yet by all (claims wait for the rest).

    An entry lives from a hold's first placement until its last, or until the hold is no longer
    live (expired, aborted, declined: :meth:`prune`), so the table is bounded by the live holds.
    """

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._partial: dict[str, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def pending(self, hold_id: str) -> bool:
        """Some rank has not placed ``hold_id`` yet (it is not claimable)."""
        return hold_id in self._partial

    def check_placed(self, hold_id: str) -> None:
        """UnknownHoldError (404) while some rank has not placed ``hold_id``."""
        entry = self._partial.get(hold_id)
        if entry is not None:
            raise UnknownHoldError(f"hold_id {hold_id!r}: placed by ranks {sorted(entry.ranks)} "
                                   f"of the pod's {self.ranks} only")  # fmt: skip

    def check_rank(self, hold_id: str, rank: int) -> None:
        """StoreError (422) naming ``hold_id`` while rank ``rank`` has not placed it (a save by
        the hold from that rank: the hold does not pin that rank's blocks yet)."""
        entry = self._partial.get(hold_id)
        if entry is not None and rank not in entry.ranks:
            raise StoreError("hold_id", f"{hold_id!r}: rank {rank} has not placed it (placed by "
                             f"ranks {sorted(entry.ranks)} of the pod's {self.ranks}); a rank "
                             "saves by a hold it placed")  # fmt: skip

    def first(self, req: HoldRequest, ticket: Ticket) -> Ticket:
        """Rank ``req.tp_rank`` placed the hold first (the HoldTable holds it now): ``ticket``
        is what every rank is answered (returned)."""
        self._partial[ticket.hold_id] = _Partial(
            req.request_id, req.block_ids, req.num_tokens, ticket, {req.tp_rank}
        )
        return ticket

    def add(self, req: HoldRequest) -> tuple[Ticket, bool]:
        """A later rank's placement of a pending hold: the pod's ticket, and whether that was
        the last rank (the hold is claimable now). A rank placing it again with the same terms
        is answered the same (nothing changes). PodConflictError (409) naming the field when
        its terms differ from the first placement's."""
        entry = self._partial[req.hold_id]
        for name, ours in (("block_ids", req.block_ids), ("num_tokens", req.num_tokens),
                           ("request_id", req.request_id)):  # fmt: skip
            theirs = getattr(entry, name)
            if ours != theirs:
                raise PodConflictError(name, f"rank {req.tp_rank} placed hold {req.hold_id!r} "
                                       f"with {ours!r}; ranks {sorted(entry.ranks)} with "
                                       f"{theirs!r}")  # fmt: skip
        entry.ranks.add(req.tp_rank)
        if len(entry.ranks) == self.ranks:
            del self._partial[req.hold_id]
            return entry.ticket, True
        return entry.ticket, False

    def drop(self, hold_id: str) -> None:
        """Forget ``hold_id`` (given up)."""
        self._partial.pop(hold_id, None)

    def prune(self, live: Callable[[str], bool]) -> None:
        """Forget pending holds that are no longer live (released before every rank placed)."""
        for hold_id in [h for h in self._partial if not live(h)]:
            del self._partial[hold_id]

    def clear(self) -> None:
        self._partial.clear()


class Pod:
    """A pod sidecar's state beside the Sidecar's registration: its rank slots and its holds not
    yet placed by every rank."""

    def __init__(self, ranks: int, give_up: Callable[[str], None]) -> None:
        self.ranks = ranks
        self._give_up = give_up  # abort a live hold for every rank (the Sidecar's abort)
        self.slots = PodSlots(ranks)
        self.placements = PodPlacements(ranks)
        self.forming: asyncio.Task[None] | None = None  # the complete pod's adoption, if running

    async def register(
        self, req: RegisterRequest, sources: list[int], *, agent: Agent,
        adopt: Callable[[list[RankMemory]], Awaitable[RegisterResponse]], timeout_s: float,
    ) -> RegisterResponse:  # fmt: skip
        """A rank's register (validated, ``sources`` checked): its slot (:meth:`PodSlots.reserve`),
        its memory mapped and registered into the one ``agent``, then the pod's answer once every
        rank's memory is there (the last register has ``adopt`` run on a task of its own, which
        a register call cancelled does not stop), at most ``timeout_s`` after it came; else (or
        if it fails) its slot and memory are let go: NotRegisteredError (503, retry).

        The same rank registering the same memory (manifest, regions, instance) again, as a
        worker does whose call got no answer, is that register (:meth:`PodSlots.repeats`): it
        waits for the pod's answer with it, and the slot is let go only once every call of it
        failed or gave up."""
        deadline = time.monotonic() + timeout_s
        key = (req.regions, req.instance)
        repeat = self.slots.repeats(req.manifest, key)
        rank = req.manifest.tp_rank if repeat else self.slots.reserve(req.manifest, key)
        slot = self.slots.slot(rank)
        slot.calls += 1
        answer = self.slots.round()
        try:
            if not repeat:
                mapped = await map_sources(agent, req, sources)
                if self.slots.fill(RankMemory(req.manifest, *mapped, sources, req.instance)):
                    self.forming = asyncio.create_task(self._form(adopt, answer))
            with contextlib.suppress(TimeoutError):  # past it: once complete, the test's bound
                left = max(deadline - time.monotonic(), 0.0)
                return await asyncio.wait_for(asyncio.shield(answer), left)
            if not self.slots.complete:
                raise NotRegisteredError(
                    f"register: the pod's ranks {self.slots.missing} did not register within "
                    f"{timeout_s:g} s (--pod-register-timeout); rank {rank}'s memory was let go "
                    "(unless its register is waiting again): register again"
                )
            return await answer
        except BaseException:
            if (left_over := self.slots.leave(slot)) is not None:
                await drop_sources(agent, left_over.registrations, left_over.regions)
            raise

    async def _form(
        self, adopt: Callable[[list[RankMemory]], Awaitable[RegisterResponse]],
        answer: asyncio.Future[RegisterResponse],
    ) -> None:  # fmt: skip
        try:
            answer.set_result(await adopt(self.slots.joined()))
        except BaseException as exc:
            answer.set_exception(exc)
            raise

    def place(
        self, req: HoldRequest, live: bool, claims: Placements, check: Callable[[], None]
    ) -> Ticket | None:
        """A rank's placement of hold ``req.hold_id`` (``live``: the HoldTable has it), after
        ``check`` (the registration generation): None when it is the first (the caller holds it
        and calls :meth:`PodPlacements.first`), else the pod's ticket (:meth:`PodPlacements.add`);
        the last rank's wakes the ``claims`` waiting for it. HoldRequestError (422) without a
        hold id or rank.

        A placement of a live hold that is refused (its terms differ, its generation is stale,
        every rank placed it already) gives the hold up for every rank before the refusal is
        raised: the refused engine frees its blocks, so the hold can never be read whole, and
        the ranks that placed it free theirs now (released ``aborted``) rather than at the
        lease's end."""
        try:
            if not req.hold_id or not 0 <= req.tp_rank < self.ranks:
                name = "tp_rank" if req.hold_id else "hold_id"
                raise HoldRequestError(name, f"required on a pod sidecar (the scheduler's hold "
                                       f"id, the placing rank 0..{self.ranks - 1})")  # fmt: skip
            check()
            if not live:
                return None
            if not self.placements.pending(req.hold_id):
                raise DuplicateHoldError("hold_id", f"every rank of the pod placed "
                                         f"{req.hold_id!r} already (rank {req.tp_rank} "
                                         "again)")  # fmt: skip
            ticket, last = self.placements.add(req)
        except KvxferdError:
            if live:
                self.give_up(req.hold_id, claims)
            raise
        if last:  # every rank placed it: claimable now
            claims.placed(req.hold_id)
        return ticket

    def check_placed(self, hold_id: str, claims: Placements) -> None:
        """For a claim that waited for ``hold_id``: UnknownHoldError (404) while some rank has
        not placed it, and the hold is given up (its one pull fails: nobody will read it)."""
        try:
            self.placements.check_placed(hold_id)
        except UnknownHoldError as exc:
            self.give_up(hold_id, claims)
            raise UnknownHoldError(f"{exc}; given up (released aborted)") from None

    def give_up(self, hold_id: str, claims: Placements) -> None:
        """Abort ``hold_id`` for every rank (released ``aborted``): nothing pending is kept for
        it, and the claims waiting for it end now."""
        self.placements.drop(hold_id)
        with contextlib.suppress(KvxferdError):  # released meanwhile, or all let go already
            self._give_up(hold_id)
        claims.placed(hold_id)

    def store_target(self, tp_rank: int) -> tuple[Manifest, list[Any]]:
        """Rank ``tp_rank``'s manifest and a host view of each of its regions (a store call's
        memory on a registered pod: each rank saves and loads its own blocks, under entries
        named by its rank); StoreError (422) naming ``tp_rank`` unless it is a rank of the pod."""
        if not 0 <= tp_rank < self.ranks:
            raise StoreError("tp_rank", f"{tp_rank}: a store call on a pod sidecar names its "
                             f"rank, 0..{self.ranks - 1}")  # fmt: skip
        memory = self.slots.memory()[tp_rank]
        return memory.manifest, host_views(memory.regions, memory.sources, memory.manifest)

    def reset(self) -> list[RankMemory]:
        """Forget the pod (unregistered, or the sidecar closes): the memory its slots held."""
        self.placements.clear()
        return self.slots.clear()


__all__ = [
    "PER_RANK_REGION_FIELDS",
    "Pod",
    "PodPlacements",
    "PodSlots",
    "RankMemory",
    "Slot",
    "first_difference",
]
