"""A peer call the prefill side may get twice: the decode's HTTP client sends a request again on
a new connection when a kept one closed unanswered, and the peer may have read and done the
first one before it closed. Against an in-process prefill Sidecar (HoldTable and its peer
handlers), driven directly.

A heartbeat sent twice does what one does (the lease extended, the same answer); a decline sent
twice releases the hold once (the second answers ``missing``: already gone). A claim sent twice
by its reader takes no second reader slot, but it counts a second READ (the same tickets pulled
twice), so the pull's one notification would leave the hold pinned until the claim ends, and a
hold its reader's TP shape reads nothing of is gone at the second claim (404).
"""

from __future__ import annotations

import pytest

from kvxferd.errors import ClaimMismatchError, UnknownHoldError
from kvxferd.sidecar.holds import NotifyOutcome
from kvxferd.sidecar.service import Sidecar
from kvxferd.wire import (
    ClaimRequest,
    DeclineRequest,
    Heartbeat,
    HeartbeatResponse,
    HoldRequest,
    RegisterRequest,
)
from tests.sidecar.holdtable import req, table
from tests.sidecar.inprocess import chosen_ticket, run_in_process

pytestmark = pytest.mark.nixl
HOLD = "chosen-1"


async def _held(sidecar: Sidecar, register: RegisterRequest) -> int:
    """Register and place hold HOLD (request r1, block 5); the registration's generation."""
    generation = (await sidecar.register(register)).generation
    sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16, hold_id=HOLD,
                             generation=generation))  # fmt: skip
    return generation


def test_a_heartbeat_sent_twice_does_what_one_does():
    async def twice(sidecar: Sidecar, register: RegisterRequest) -> None:
        await _held(sidecar, register)
        holds = sidecar.holds
        assert holds is not None
        beat = Heartbeat(hold_ids=[HOLD, "gone-1"], extend_s=300.0)
        first = sidecar.heartbeat(beat)
        extended_to = holds.get(HOLD).expires_at
        assert sidecar.heartbeat(beat) == first == HeartbeatResponse(
            extended=[HOLD], missing=["gone-1"])  # fmt: skip
        hold = holds.get(HOLD)
        assert hold.expires_at >= extended_to and hold.reading == {} and hold.reason is None
        assert holds.released_since(0).holds == []

    run_in_process(twice, engine_id="repeat-heartbeat")


def test_a_decline_sent_twice_releases_the_hold_once_and_answers_missing_the_second_time():
    async def twice(sidecar: Sidecar, register: RegisterRequest) -> None:
        ticket = chosen_ticket(sidecar, await _held(sidecar, register), HOLD)
        decline = DeclineRequest(tickets=[ticket], reason="aborted")
        first, second = sidecar.accept_decline(decline), sidecar.accept_decline(decline)
        assert (first.released, first.missing, first.busy) == ([HOLD], [], [])
        assert (second.released, second.missing, second.busy) == ([], [HOLD], [])
        holds = sidecar.holds
        assert holds is not None and HOLD not in holds
        released = [(r.hold_id, r.reason) for r in holds.released_since(0).holds]
        assert released == [(HOLD, "declined")]

    run_in_process(twice, engine_id="repeat-decline")


def test_a_claim_sent_twice_takes_no_second_reader_slot_but_counts_a_second_read():
    async def twice(sidecar: Sidecar, register: RegisterRequest) -> None:
        ticket = chosen_ticket(sidecar, await _held(sidecar, register), HOLD)
        claim = ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=5.0)
        first, second = await sidecar.claim(claim), await sidecar.claim(claim)
        assert (first.hold_id, first.expected_readers) == (second.hold_id, 1)
        holds = sidecar.holds
        assert holds is not None
        with pytest.raises(ClaimMismatchError) as err:  # d0 holds the hold's one reader slot
            await sidecar.claim(ClaimRequest(ticket=ticket, reader="d1", reader_tp_size=1,
                                             claim_s=5.0))  # fmt: skip
        assert err.value.field == "reader" and holds.get(HOLD).readers == {"d0"}
        # The pull's one READ notifies once: the hold waits for a second READ that never comes.
        assert holds.notify(HOLD, "d0") is NotifyOutcome.COUNTED
        assert HOLD in holds and holds.released_since(0).holds == []

    run_in_process(twice, engine_id="repeat-claim")


def test_a_claim_sent_twice_of_a_hold_its_reader_reads_nothing_of_is_refused_the_second_time():
    t = table()  # a reader TP shape that reads nothing of this rank expects 0 readers
    hold = t.hold(req())
    assert t.claim(hold.hold_id, "d0", 5.0, expected_readers=0).expected_readers == 0
    with pytest.raises(UnknownHoldError, match="already released"):
        t.claim(hold.hold_id, "d0", 5.0, expected_readers=0)
