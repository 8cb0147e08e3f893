"""A pod sidecar's holds: every rank places the scheduler's hold id with its own ``tp_rank``; the
hold is claimable only once every rank placed it (a claim before waits ``hold_grace_s``, then
succeeds, or 404s and gives the hold up); every rank is answered the same signed pod ticket (tp_rank
0, tp_size N, ranks N); later ranks must name the same blocks, tokens and request, and a refused
placement gives the hold up on every rank; an abort from any rank ends the hold; one release, which
every rank's worker reads with its own cursor; claims check the ticket's ranks against the sidecar's
and expect one reader per decode rank.

An in-process pod Sidecar over POSIX shm (self-test READ over NIXL loopback), driven on one loop.
"""

from __future__ import annotations

import asyncio

import pytest
from msgspec import structs

from kvxferd.errors import (
    ClaimMismatchError,
    DuplicateHoldError,
    HoldRequestError,
    KvxferdError,
    UnknownHoldError,
)
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.tickets import sign_ticket, verify_ticket
from kvxferd.wire import AbortHoldRequest, ClaimRequest, ClaimResponse, Ticket
from tests.sidecar.harness import TOKEN
from tests.sidecar.inprocess import chosen_ticket, run_in_process
from tests.sidecar.pods import PodPools, hold_on_all, hold_request, run_pod, until

pytestmark = pytest.mark.nixl


def claim(sidecar: Sidecar, ticket: Ticket, reader_tp_size: int = 1,
          reader: str = "d0") -> asyncio.Task[ClaimResponse]:  # fmt: skip
    return asyncio.create_task(sidecar.claim(ClaimRequest(
        ticket=ticket, reader=reader, reader_tp_size=reader_tp_size, claim_s=5.0
    )))  # fmt: skip


def test_every_rank_gets_the_same_signed_pod_ticket():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        gen = sidecar.generation
        tickets = [sidecar.hold(hold_request(r, gen)) for r in (2, 0, 3, 1)]  # any rank first
        assert tickets[0] == tickets[1] == tickets[2] == tickets[3]
        ticket = tickets[0]
        verify_ticket(ticket, TOKEN.encode())
        assert (ticket.tp_rank, ticket.tp_size, ticket.ranks) == (0, 4, 4)
        assert (ticket.hold_id, ticket.generation, ticket.engine_id) == (
            "pod-h1", gen, sidecar.engine_id)  # fmt: skip
        assert len(sidecar.holds) == 1  # one hold for the pod, not one per rank
        assert len(sidecar.pod.placements) == 0  # nothing pending once all placed

    run_pod(scenario, ranks=4, engine_id="pod-ticket", registered=True)


def test_a_claim_before_every_rank_placed_waits_and_then_succeeds():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = sidecar.hold(hold_request(0, sidecar.generation))
        early = claim(sidecar, ticket, reader_tp_size=2)
        await until(lambda: len(sidecar._placements) == 1, "the claim waiting for its hold")
        for rank in (3, 1):
            sidecar.hold(hold_request(rank, sidecar.generation))
            woken, _ = sidecar._placements._waiting[ticket.hold_id]
            assert not woken.is_set() and not early.done()  # a rank still missing: it waits
        sidecar.hold(hold_request(2, sidecar.generation))
        granted = await asyncio.wait_for(early, 10)
        assert granted.hold_id == ticket.hold_id
        assert granted.expected_readers == 2  # every decode rank reads the pod once

    run_pod(scenario, ranks=4, engine_id="pod-claim-waits", registered=True, hold_grace_s=20.0)


def test_a_claim_of_a_hold_a_rank_never_placed_404s_after_the_grace_and_gives_it_up():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = sidecar.hold(hold_request(1, sidecar.generation))
        with pytest.raises(UnknownHoldError, match=r"placed by ranks \[1\] of the pod's 2 only"):
            await asyncio.wait_for(claim(sidecar, ticket), 10)
        # Its one pull failed: rank 1's blocks are released now, not at the lease's end.
        feed = sidecar.released_since(0)
        assert [(h.hold_id, h.reason) for h in feed.holds] == [(ticket.hold_id, "aborted")]
        assert len(sidecar.holds) == 0 and len(sidecar.pod.placements) == 0
        with pytest.raises(DuplicateHoldError):  # the late rank is refused: its engine frees
            sidecar.hold(hold_request(0, sidecar.generation))
        assert len(sidecar.holds) == 0

    run_pod(scenario, ranks=2, engine_id="pod-claim-404", registered=True, hold_grace_s=0.2)


def test_later_ranks_must_place_the_same_hold_and_a_refused_one_gives_it_up_on_every_rank():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        gen = sidecar.generation
        with pytest.raises(HoldRequestError) as no_rank:
            sidecar.hold(hold_request(-1, gen))
        assert no_rank.value.field == "tp_rank" and no_rank.value.status == 422
        with pytest.raises(HoldRequestError) as no_id:
            sidecar.hold(hold_request(0, gen, hold_id=""))
        assert no_id.value.field == "hold_id"
        with pytest.raises(HoldRequestError) as past:
            sidecar.hold(hold_request(2, gen))
        assert past.value.field == "tp_rank"
        assert len(sidecar.holds) == 0  # nothing was placed by those
        given_up = []
        for field, value in (("block_ids", [[3, 1, 7, 6]]), ("num_tokens", 59),
                             ("request_id", "r2"), ("generation", gen - 1)):  # fmt: skip
            hold_id = f"pod-{field}"
            first = sidecar.hold(hold_request(0, gen, hold_id=hold_id, request_id=hold_id))
            terms = {"request_id": hold_id, field: value}
            later = hold_request(1, terms.pop("generation", gen), hold_id=hold_id, **terms)
            with pytest.raises(KvxferdError) as differs:
                sidecar.hold(later)
            assert differs.value.field == field and differs.value.status in (404, 409)
            given_up.append((first.hold_id, "aborted"))
            assert [(h.hold_id, h.reason) for h in sidecar.released_since(0).holds] == given_up
        assert len(sidecar.holds) == 0 and len(sidecar.pod.placements) == 0
        first = sidecar.hold(hold_request(0, gen))
        assert sidecar.hold(hold_request(0, gen)) == first  # a rank placing it again: the same
        assert sidecar.hold(hold_request(1, gen)) == first  # the last rank: claimable
        with pytest.raises(DuplicateHoldError):  # placed by all: a repeat is refused (409) and,
            sidecar.hold(hold_request(1, gen))  # as that engine frees its blocks, given up
        assert sidecar.released_since(0).holds[-1].hold_id == first.hold_id
        assert len(sidecar.holds) == 0

    run_pod(scenario, ranks=2, engine_id="pod-placement-terms", registered=True)


def test_an_abort_from_any_rank_ends_the_hold_once_and_every_worker_reads_the_release():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        gen = sidecar.generation
        ticket = sidecar.hold(hold_request(0, gen))
        waiting = claim(sidecar, ticket)
        await until(lambda: len(sidecar._placements) == 1, "the claim waiting for its hold")
        sidecar.abort(AbortHoldRequest(hold_id=ticket.hold_id))  # rank 1's worker gives it up
        with pytest.raises(UnknownHoldError):
            await asyncio.wait_for(waiting, 10)  # at once, not after the grace
        assert len(sidecar.pod.placements) == 0  # nothing pending is kept for it
        with pytest.raises(DuplicateHoldError):  # rank 1's placement after the abort
            sidecar.hold(hold_request(1, gen))
        # Every worker follows the released feed with its own cursor and sees it once.
        rank0 = sidecar.released_since(0)
        assert [(h.hold_id, h.reason) for h in rank0.holds] == [(ticket.hold_id, "aborted")]
        assert sidecar.released_since(rank0.cursor).holds == []  # rank 0 read it already
        rank1 = sidecar.released_since(0)  # rank 1 reads from its own cursor
        assert [h.hold_id for h in rank1.holds] == [ticket.hold_id]
        assert rank1.cursor == rank0.cursor

    run_pod(scenario, ranks=2, engine_id="pod-abort", registered=True, hold_grace_s=20.0)


def test_a_hold_released_before_every_rank_placed_it_is_not_kept_pending():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        sidecar.start()  # the reaper expires the lease
        ticket = sidecar.hold(hold_request(0, sidecar.generation, lease_s=0.2))
        assert sidecar.pod.placements.pending(ticket.hold_id)
        await until(lambda: len(sidecar.pod.placements) == 0, "the lease's end to prune it")
        assert [h.reason for h in sidecar.released_since(0).holds] == ["expired"]
        with pytest.raises(DuplicateHoldError):  # the late rank finds it gone
            sidecar.hold(hold_request(1, sidecar.generation))

    run_pod(scenario, ranks=2, engine_id="pod-expired", registered=True)


def test_a_released_pod_hold_is_released_once_for_all_its_readers():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = hold_on_all(sidecar, pools)
        grants = [await claim(sidecar, ticket, reader_tp_size=2, reader=f"d{i}") for i in (0, 1)]
        assert [g.expected_readers for g in grants] == [2, 2]
        for reader in ("d0", "d1"):  # each decode rank's notification releases its share
            sidecar.holds.notify(ticket.hold_id, reader)
        sidecar._after_release()
        feed = sidecar.released_since(0)
        assert [(h.hold_id, h.reason) for h in feed.holds] == [(ticket.hold_id, "notified")]

    run_pod(scenario, ranks=2, engine_id="pod-readers", registered=True)


def test_a_pod_refuses_a_rank_ticket_and_a_rank_sidecar_a_pod_ticket():
    async def pod(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = hold_on_all(sidecar, pools)
        per_rank = sign_ticket(structs.replace(ticket, ranks=1, token=""), TOKEN.encode())
        with pytest.raises(ClaimMismatchError) as rank_shape:
            await claim(sidecar, per_rank)
        assert rank_shape.value.field == "ticket.ranks" and rank_shape.value.status == 409
        rank1 = sign_ticket(structs.replace(ticket, tp_rank=1, token=""), TOKEN.encode())
        with pytest.raises(ClaimMismatchError) as rank_one:
            await claim(sidecar, rank1)
        assert rank_one.value.field == "ticket.tp_rank"

    run_pod(pod, ranks=2, engine_id="pod-shapes", registered=True)

    async def one_rank(sidecar: Sidecar, register) -> None:  # noqa: ANN001
        generation = (await sidecar.register(register)).generation
        ticket = chosen_ticket(sidecar, generation)
        pod_ticket = sign_ticket(structs.replace(ticket, tp_size=1, ranks=2, token=""),
                                 TOKEN.encode())  # fmt: skip
        with pytest.raises(ClaimMismatchError) as shape:
            await sidecar.claim(ClaimRequest(ticket=pod_ticket, reader="d0", reader_tp_size=1,
                                             claim_s=5.0))  # fmt: skip
        assert shape.value.field == "ticket.ranks"

    run_in_process(one_rank, engine_id="rank-refuses-pod-ticket")
