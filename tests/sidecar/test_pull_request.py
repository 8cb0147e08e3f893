"""validate_pull checks a pull's local block ids once for all prefill ranks: in range (or -1)
and no id twice in a group, a 422 naming the entry (each rank's plan then skips that check);
with a token count, no more ids per group than the tokens' blocks or the ticket's list."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.errors import BlockIdError
from kvxferd.sidecar.pull_request import validate_pull
from kvxferd.wire import PullRequest, Ticket
from tests.descriptors.layouts import hybrid_spec, render


def _request(local_ids: list[list[int]], tp: int = 2) -> PullRequest:
    remote = [list(range(10, 10 + len(g))) for g in local_ids]
    tickets = [
        Ticket(engine_id="e", epoch=1, hold_id=f"h{r}", request_id="r", block_ids=remote,
               num_tokens=16, expires_at=0.0, tp_rank=r, tp_size=tp, peer="127.0.0.1:1")
        for r in range(tp)
    ]  # fmt: skip
    return PullRequest(tickets=tickets, block_ids=local_ids)


def test_valid_ids_and_skipped_ones_pass():
    m = render(hybrid_spec())
    validate_pull(_request([[1, -1, 2], [3], [-1]]), m)


@pytest.mark.parametrize(
    ("ids", "field"),
    [
        ([[1, 4, 5, 4], [2], [3]], "block_ids[0][3]"),
        ([[1], [2, -1, 2], [3]], "block_ids[1][2]"),
    ],
)
def test_an_id_repeated_in_a_group_is_refused_naming_the_repeat(ids, field):
    m = render(hybrid_spec())
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_request(ids), m)
    assert exc.value.field == field
    assert "repeats" in str(exc.value)


def test_an_id_outside_the_pool_is_refused():
    m = render(hybrid_spec())
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_request([[1], [m.num_blocks], [3]]), m)
    assert exc.value.field == "block_ids[1][0]"


@pytest.mark.parametrize("deadline_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_deadline_that_is_not_a_finite_positive_number_is_refused(deadline_s):
    # NaN and inf cannot come as JSON but can as msgpack; a NaN timer breaks the loop's heap.
    m = render(hybrid_spec())
    req = msgspec.structs.replace(_request([[1], [2], [3]]), deadline_s=deadline_s)
    with pytest.raises(BlockIdError) as exc:
        validate_pull(req, m)
    assert exc.value.field == "deadline_s"


def test_a_deadline_past_the_allowed_maximum_is_refused_naming_deadline_s():
    m = render(hybrid_spec())
    req = msgspec.structs.replace(_request([[1], [2], [3]]), deadline_s=600.5)
    validate_pull(msgspec.structs.replace(req, deadline_s=600.0), m, max_deadline_s=600.0)
    with pytest.raises(BlockIdError) as exc:
        validate_pull(req, m, max_deadline_s=600.0)
    assert exc.value.field == "deadline_s"


def _by_tokens(
    local_ids: list[list[int]], ticket_ids: list[list[int]], num_tokens: int
) -> PullRequest:
    ticket = Ticket(engine_id="e", epoch=1, hold_id="h", request_id="r",
                    block_ids=ticket_ids, num_tokens=16, expires_at=0.0, tp_rank=0, tp_size=1,
                    peer="127.0.0.1:1")  # fmt: skip
    return PullRequest(tickets=[ticket], block_ids=local_ids, num_tokens=num_tokens)


def test_with_a_token_count_a_group_lists_at_most_the_logical_blocks_its_tokens_span():
    # hybrid_spec: attention in logical blocks of 4 tokens (kernel blocks of 2), then 2 mamba
    # groups. 10 tokens span 3 logical blocks (5 kernel blocks: not the bound).
    m = render(hybrid_spec())
    ticket = [[10], [11], [12]]
    validate_pull(_by_tokens([[1, -1, 2], [3], [4]], ticket, 10), m)
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_by_tokens([[1, -1, 2, -1], [3], [4]], ticket, 10), m)
    assert exc.value.field == "block_ids[0]"
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_by_tokens([[1], [3], [-1, 4, -1, -1]], ticket, 10), m)
    assert exc.value.field == "block_ids[2]"


def test_a_state_group_may_list_its_one_block_even_for_no_tokens():
    m = render(hybrid_spec())
    validate_pull(_by_tokens([[], [3], [4]], [[10], [11], [12]], 0), m)


def test_with_a_token_count_a_group_may_list_as_many_ids_as_the_tickets_list():
    # Equal block sizes pair ids one to one, and the prefill may hold a block past the tokens
    # asked for (partial prefill: the decode recomputes the last token).
    m = render(hybrid_spec())
    ticket = [[10, 11, 12, 13], [14], [15]]
    validate_pull(_by_tokens([[1, 2, 3, -1], [4], [5]], ticket, 10), m)
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_by_tokens([[1, 2, 3, -1, -1], [4], [5]], ticket, 10), m)
    assert exc.value.field == "block_ids[0]"


def test_a_ticket_grouped_otherwise_does_not_widen_the_bound():
    # Different grouping maps tokens, never ids one to one: only the tokens' blocks count.
    m = render(hybrid_spec())
    ticket = [[10, 11, 12, 13, 14, 15], [16]]
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_by_tokens([[1, 2, 3, -1], [4], [5]], ticket, 10), m)
    assert exc.value.field == "block_ids[0]"


def test_a_flood_of_skipped_ids_is_refused_before_it_is_walked():
    m = render(hybrid_spec())
    flood = [-1] * 1_000_000 + [m.num_blocks]  # an id out of range past the bound
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_by_tokens([flood, [3], [4]], [[10], [11], [12]], 16), m)
    assert exc.value.field == "block_ids[0]"


def _pod_request(tickets: int, ranks: int, tp: int) -> PullRequest:
    one = _request([[1], [2], [3]], tp=1).tickets[0]
    pod = msgspec.structs.replace(one, tp_size=tp, ranks=ranks)
    return PullRequest(tickets=[pod] * tickets, block_ids=[[1], [2], [3]])


def test_a_pod_sidecars_one_ticket_stands_for_every_prefill_rank():
    validate_pull(_pod_request(tickets=1, ranks=4, tp=4), render(hybrid_spec()))


@pytest.mark.parametrize(
    ("tickets", "ranks", "tp"),
    [(2, 2, 2), (1, 2, 4), (1, 4, 2)],
    ids=["two pod tickets", "spans fewer ranks than the TP", "spans more ranks than the TP"],
)
def test_a_pod_ticket_that_is_not_the_one_ticket_of_every_rank_is_refused(tickets, ranks, tp):
    with pytest.raises(BlockIdError) as exc:
        validate_pull(_pod_request(tickets, ranks, tp), render(hybrid_spec()))
    assert exc.value.field == "tickets[0].ranks"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"request_id": "other"}, "tickets[1].request_id"),
        ({"num_tokens": 8}, "tickets[1].num_tokens"),
    ],
)
def test_tickets_of_another_request_are_refused_naming_the_ticket_that_differs(change, field):
    # Each ticket's MAC is its own: rank 1's ticket of another request (same block ids) would
    # claim that request's hold and read its KV into this one's blocks, planned by ticket 0's.
    m = render(hybrid_spec())
    req = _request([[1], [2], [3]])
    tickets = [req.tickets[0], msgspec.structs.replace(req.tickets[1], **change)]
    with pytest.raises(BlockIdError) as exc:
        validate_pull(msgspec.structs.replace(req, tickets=tickets), m)
    assert exc.value.field == field
    assert "differs from tickets[0]" in str(exc.value)


@pytest.mark.parametrize("bad", [1 << 63, (1 << 64) - 1, -1])
def test_a_ticket_id_no_pool_can_have_is_refused_before_the_plan(bad):
    # msgpack carries ids up to 2**64-1: past int64 the plan failed "internal" (OverflowError).
    m = render(hybrid_spec())
    req = _request([[1, 2], [3], [4]])
    remote = [[10, bad], [11], [12]]
    tickets = [msgspec.structs.replace(t, block_ids=remote) for t in req.tickets]
    with pytest.raises(BlockIdError) as exc:
        validate_pull(msgspec.structs.replace(req, tickets=tickets), m)
    assert exc.value.field == "tickets[0].block_ids[0][1]"
