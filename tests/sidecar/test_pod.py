"""The pod's bookkeeping on its own (kvxferd.sidecar.pod): rank slots and what their manifests
must agree on, the answer every rank of a forming pod shares, and holds pending until every
rank placed them. Pure: no memory, no agent."""

from __future__ import annotations

import asyncio

import pytest
from msgspec import structs

from kvxferd.errors import (
    DuplicateHoldError,
    HoldRequestError,
    ManifestError,
    PodConflictError,
    RegisterInProgressError,
    StaleGenerationError,
    UnknownHoldError,
)
from kvxferd.sidecar.placements import Placements
from kvxferd.sidecar.pod import Pod, PodPlacements, PodSlots, RankMemory, first_difference
from kvxferd.wire import HoldRequest, Ticket
from tests.sidecar.harness import plan
from tests.sidecar.pods import until

MODEL = "llama-3.1-8b"


def ranks(n: int) -> list:
    """The manifests of a TP ``n`` engine's ranks (each rank's own segment names)."""
    return [plan(MODEL, tp_size=n, tp_rank=r, num_blocks=8) for r in range(n)]


def memory(manifest, tag: str = "") -> RankMemory:  # noqa: ANN001
    n = len(manifest.regions)
    return RankMemory(manifest, [f"{tag}region{i}" for i in range(n)],
                      [f"{tag}reg{i}" for i in range(n)], list(range(n)), list(range(n)),
                      instance=tag)  # fmt: skip


def test_slots_fill_in_any_order_and_complete_with_the_last():
    slots = PodSlots(4)
    manifests = ranks(4)
    for rank in (2, 0, 3):
        assert slots.reserve(manifests[rank]) == rank
        assert slots.fill(memory(manifests[rank], f"r{rank}")) is False
    assert slots.missing == [1] and not slots.complete
    slots.reserve(manifests[1])
    assert slots.missing == [1]  # reserved is not registered: its memory is not there yet
    assert slots.fill(memory(manifests[1], "r1")) is True
    joined = slots.joined()
    assert joined.manifest is manifests[0] and joined.instance == "r0"
    assert joined.regions[: len(manifests[0].regions)] == memory(manifests[0], "r0").regions
    assert len(joined.registrations) == 4 * len(manifests[0].regions)
    layouts = slots.layouts("engine-x", 7)
    assert [lay.manifest.tp_rank for lay in layouts] == [1, 2, 3]
    assert {(lay.manifest.engine_id, lay.manifest.epoch) for lay in layouts} == {("engine-x", 7)}


def test_a_taken_rank_another_tp_size_or_a_differing_field_is_refused_and_takes_nothing():
    slots = PodSlots(2)
    manifests = ranks(2)
    slots.reserve(manifests[0])
    with pytest.raises(PodConflictError) as taken:
        slots.reserve(manifests[0])
    assert taken.value.field == "manifest.tp_rank"
    with pytest.raises(ManifestError) as size:
        slots.reserve(ranks(4)[1])
    assert size.value.field == "manifest.tp_size"
    group = structs.replace(manifests[1].groups[0], block_size=32)
    with pytest.raises(PodConflictError) as differs:
        slots.reserve(structs.replace(manifests[1], groups=[group]))
    assert differs.value.field == "manifest.groups[0].block_size"
    region = structs.replace(manifests[1].regions[3], page_bytes=1)
    with pytest.raises(PodConflictError) as page:
        slots.reserve(
            structs.replace(
                manifests[1], regions=[*manifests[1].regions[:3], region, *manifests[1].regions[4:]]
            )
        )
    assert page.value.field == "manifest.regions[3].page_bytes"
    assert slots.missing == [0, 1]
    # What is each rank's own: segment names, GPU, place in the allocation, engine id.
    own = [structs.replace(r, device_id=1, source_offset=0) for r in manifests[1].regions]
    assert slots.reserve(structs.replace(manifests[1], regions=own, engine_id="x")) == 1


def test_a_vacated_slot_can_be_taken_again_and_clear_gives_back_every_memory():
    slots = PodSlots(2)
    manifests = ranks(2)
    slots.reserve(manifests[0])
    slots.fill(memory(manifests[0], "a"))
    assert slots.vacate(0).instance == "a"
    assert slots.vacate(0) is None  # once
    slots.reserve(manifests[0])  # free again
    slots.fill(memory(manifests[0], "b"))
    slots.reserve(manifests[1])
    assert [m.instance for m in slots.clear()] == ["b"]  # rank 1 reserved, not mapped
    assert slots.missing == [0, 1]
    slots.reserve(manifests[1])  # nothing of the old pod is in the way


def test_a_repeat_is_the_same_rank_manifest_and_key_once_mapped_and_the_last_call_vacates():
    slots = PodSlots(2)
    manifests = ranks(2)
    assert slots.repeats(manifests[0], "k") is False  # nothing there
    slots.reserve(manifests[0], "k")
    with pytest.raises(RegisterInProgressError):  # its first call still maps the memory
        slots.repeats(manifests[0], "k")
    slots.fill(memory(manifests[0], "a"))
    assert slots.repeats(manifests[0], "k") is True
    assert slots.repeats(manifests[0], "other memory") is False  # reserve refuses it then
    assert slots.repeats(structs.replace(manifests[0], model="m"), "k") is False
    slot = slots.slot(0)
    slot.calls = 2
    assert slots.leave(slot) is None and slots.missing == [1]  # another call still waits
    assert slots.leave(slot).instance == "a" and slots.missing == [0, 1]
    slots.reserve(manifests[0], "k")
    slots.clear()
    slots.reserve(manifests[0], "k")  # a new registration in the slot
    slot.calls = 1
    assert slots.leave(slot) is None and slots.slot(0) is not slot  # a cleared slot: left alone


def test_first_difference_names_the_path():
    assert first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == "manifest.a[1].b"
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == "manifest.a"
    assert first_difference({"a": 1}, {"a": 1, "c": 2}) == "manifest.c"
    assert first_difference({"a": [1]}, {"a": [1]}) is None


def test_every_rank_of_a_forming_pod_shares_one_answer_and_a_cleared_pod_gets_a_new_one():
    async def main() -> None:
        slots = PodSlots(2)
        answer = slots.round()
        assert slots.round() is answer
        answer.set_result("generation 5")
        assert slots.round() is not answer  # answered while incomplete: a new round starts
        manifests = ranks(2)
        for m in manifests:
            slots.reserve(m)
            slots.fill(memory(m))
        done = slots.round()
        done.set_result("generation 6")
        assert slots.round() is done  # complete: the same answer to every rank
        slots.clear()
        assert slots.round() is not done

    asyncio.run(main())


def ticket(hold_id: str = "h1") -> Ticket:
    return Ticket(engine_id="e", epoch=1, hold_id=hold_id, request_id="r1", block_ids=[[1, 2]],
                  num_tokens=20, expires_at=0.0, tp_rank=0, tp_size=3, ranks=3, peer="p:1",
                  token="ab" * 32)  # fmt: skip


def placement(rank: int, hold_id: str = "h1", **kw) -> HoldRequest:  # noqa: ANN003
    terms = {"request_id": "r1", "block_ids": [[1, 2]], "num_tokens": 20, **kw}
    return HoldRequest(hold_id=hold_id, tp_rank=rank, **terms)


def test_a_hold_is_pending_until_its_last_rank_and_every_rank_gets_the_first_ticket():
    table = PodPlacements(3)
    t = ticket()
    assert table.first(placement(1), t) is t
    assert table.pending("h1")
    with pytest.raises(UnknownHoldError, match=r"placed by ranks \[1\] of the pod's 3 only"):
        table.check_placed("h1")
    assert table.add(placement(0)) == (t, False)
    assert table.add(placement(0)) == (t, False)  # a rank placing it again: the same answer
    assert table.add(placement(1)) == (t, False)  # so does the first rank
    for field, value in (("block_ids", [[1, 3]]), ("num_tokens", 21), ("request_id", "r2")):
        with pytest.raises(PodConflictError) as differs:
            table.add(placement(2, **{field: value}))
        assert differs.value.field == field
    assert table.add(placement(2)) == (t, True)
    assert not table.pending("h1") and len(table) == 0
    table.check_placed("h1")  # claimable


def test_pending_holds_no_longer_live_are_pruned():
    table = PodPlacements(2)
    table.first(placement(0, "a"), ticket("a"))
    table.first(placement(0, "b"), ticket("b"))
    table.prune(lambda hold_id: hold_id == "b")
    assert not table.pending("a") and table.pending("b") and len(table) == 1
    table.clear()
    assert len(table) == 0


def no_check() -> None:
    """The generation check of a current placement."""


def test_pod_place_needs_a_hold_id_and_rank_and_wakes_claims_at_the_last_rank():
    async def main() -> None:
        given_up: list[str] = []
        pod = Pod(2, given_up.append)
        claims = Placements()
        for req, field in ((placement(-1), "tp_rank"), (placement(2), "tp_rank"),
                           (placement(0, hold_id=""), "hold_id")):  # fmt: skip
            with pytest.raises(HoldRequestError) as bad:
                pod.place(req, False, claims, no_check)
            assert bad.value.field == field
        assert pod.place(placement(0), False, claims, no_check) is None  # first: caller holds
        t = ticket()
        pod.placements.first(placement(0), t)
        assert pod.place(placement(1), False, claims, no_check) is None  # gone: hold again
        waiter = asyncio.create_task(claims.wait("h1", 30.0))
        await until(lambda: len(claims) == 1, "the claim waiting")
        assert pod.place(placement(1), True, claims, no_check) is t
        await asyncio.wait_for(waiter, 5)  # woken by the last rank, long before the 30 s
        assert given_up == []

    asyncio.run(main())


def stale() -> None:
    raise StaleGenerationError("generation 3 is not the registered 4")


@pytest.mark.parametrize(
    ("later", "check", "error", "field"),
    [
        (placement(1, num_tokens=21), no_check, PodConflictError, "num_tokens"),
        (placement(1, block_ids=[[1, 3]]), no_check, PodConflictError, "block_ids"),
        (placement(1), stale, StaleGenerationError, "generation"),
        (placement(5), no_check, HoldRequestError, "tp_rank"),
    ],
    ids=["other-tokens", "other-blocks", "stale-generation", "no-such-rank"],
)
def test_a_refused_placement_of_a_pending_hold_gives_it_up_for_every_rank(
    later,
    check,
    error,
    field,  # noqa: ANN001
):
    """The refused rank's engine frees its blocks: the hold can never be read whole, so the
    ranks that placed it are not left holding theirs until the lease ends."""

    async def main() -> None:
        given_up: list[str] = []
        pod = Pod(3, given_up.append)
        claims = Placements()
        pod.placements.first(placement(0), ticket())
        waiter = asyncio.create_task(claims.wait("h1", 30.0))
        await until(lambda: len(claims) == 1, "the claim waiting")
        with pytest.raises(error) as refused:
            pod.place(later, True, claims, check)
        assert refused.value.field == field
        assert given_up == ["h1"] and not pod.placements.pending("h1")
        await asyncio.wait_for(waiter, 5)  # the waiting claim ends now, not after its grace

    asyncio.run(main())


def test_a_refused_first_placement_gives_nothing_up_and_a_repeat_of_a_placed_hold_does():
    given_up: list[str] = []
    pod = Pod(2, given_up.append)
    with pytest.raises(StaleGenerationError):  # no hold yet: nothing to give up
        pod.place(placement(0), False, Placements(), stale)
    assert given_up == []
    pod.placements.first(placement(0), ticket())
    assert pod.place(placement(1), True, Placements(), no_check) is not None  # all placed
    with pytest.raises(DuplicateHoldError) as again:  # its engine frees the blocks: given up
        pod.place(placement(1), True, Placements(), no_check)
    assert again.value.field == "hold_id" and given_up == ["h1"]


def test_a_claim_that_outwaited_a_rank_gives_the_hold_up():
    given_up: list[str] = []
    pod = Pod(2, given_up.append)
    pod.placements.first(placement(1), ticket())
    with pytest.raises(
        UnknownHoldError, match=r"placed by ranks \[1\] of the pod's 2 only; given up"
    ):
        pod.check_placed("h1", Placements())
    assert given_up == ["h1"] and not pod.placements.pending("h1")
    pod.check_placed("h1", Placements())  # nothing pending: the HoldTable answers from here
