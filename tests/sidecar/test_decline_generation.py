"""A decline binds only to a hold of the registration, epoch and request its ticket names, as a
claim does: a ticket an engine's scheduler minted before it re-registered (sleep and wake) never
releases a hold placed since under the same id.

An in-process Sidecar over POSIX shm (its self-test READ over NIXL loopback), driven directly.
"""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import DeclineRequest, HoldRequest, RegisterRequest, UnregisterRequest
from tests.sidecar.harness import TOKEN
from tests.sidecar.inprocess import chosen_ticket, run_in_process

pytestmark = pytest.mark.nixl


def test_a_ticket_of_an_earlier_registration_or_another_request_declines_nothing():
    async def decline_across_re_registration(sidecar: Sidecar, register: RegisterRequest) -> None:
        first = await sidecar.register(register)
        old = chosen_ticket(sidecar, first.generation)
        await sidecar.unregister(UnregisterRequest(generation=first.generation))
        second = await sidecar.register(register)
        sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16,
                                 hold_id="chosen-1", generation=second.generation))  # fmt: skip
        now = chosen_ticket(sidecar, second.generation)
        other = sign_ticket(msgspec.structs.replace(now, request_id="r2"), TOKEN.encode())
        for stale in (old, other):
            answer = sidecar.accept_decline(DeclineRequest(tickets=[stale], reason="rejected"))
            assert (answer.released, answer.missing, answer.busy) == ([], ["chosen-1"], [])
            assert "chosen-1" in sidecar.holds  # type: ignore[operator]
        answer = sidecar.accept_decline(DeclineRequest(tickets=[now], reason="rejected"))
        assert (answer.released, answer.missing) == (["chosen-1"], [])

    run_in_process(decline_across_re_registration, engine_id="decline-gen")
