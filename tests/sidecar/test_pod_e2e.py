"""A pod sidecar as an operator runs it (``kvxferd serve --pod-ranks 2``), each rank's calls
from its own client on the one engine socket, as the pod's workers make them: the registers
answer together with one generation, the identity describes the pod, every rank's hold answer
is the same signed ticket, and an abort from one rank shows in every worker's released feed."""

from __future__ import annotations

import pytest

from kvxferd.errors import NotRegisteredError
from kvxferd.sidecar.tickets import verify_ticket
from tests.sidecar.harness import TOKEN, ReleasedFeed
from tests.sidecar.pods import hold_ranks, pod_process, register_ranks

pytestmark = pytest.mark.nixl


def test_a_pod_of_two_ranks_registers_holds_and_releases_over_the_engine_socket(tmp_path):
    with pod_process(str(tmp_path), 2) as (sidecar, pools):
        with sidecar.client() as c:
            ident = c.identity()
        assert (ident.pod_ranks, ident.tp_rank, ident.tp_size) == (2, 0, 2)
        feeds = [ReleasedFeed(sidecar), ReleasedFeed(sidecar)]  # each worker's own cursor
        ticket = hold_ranks(sidecar, pools, ident.generation)
        verify_ticket(ticket, TOKEN.encode())
        assert (ticket.ranks, ticket.tp_size, ticket.generation) == (2, 2, ident.generation)
        with sidecar.client() as c:
            c.abort(ticket.hold_id)  # rank 1's worker gives the request up
        for feed in feeds:
            assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "aborted"}
            assert feed.count(ticket.hold_id) == 1
        # Any rank's unregister ends the pod; both ranks register again into a fresh one.
        with sidecar.client() as c:
            c.unregister(ident.generation)
            with pytest.raises(NotRegisteredError):
                c.released(0)  # another rank's next call
        again = register_ranks(sidecar, pools)
        assert again[0].generation == again[1].generation != ident.generation
