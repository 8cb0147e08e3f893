"""ClientSlots: a request borrows one client; idle clients are reused most-recent first, new
ones are made only while none is idle, and past the limit the least busy one is shared."""

from __future__ import annotations

import pytest

from kvxferd.proxy.clients import ClientSlots


class _Made:
    def __init__(self) -> None:
        self.clients: list[object] = []

    def __call__(self) -> object:
        self.clients.append(object())
        return self.clients[-1]


def test_one_request_at_a_time_always_gets_the_same_warm_client():
    made = _Made()
    slots = ClientSlots(made, limit=4)  # type: ignore[arg-type]
    for _ in range(5):
        c = slots.take()
        slots.give(c)
    assert made.clients == [c] and slots.busy() == 0


def test_requests_in_flight_each_get_their_own_client_up_to_the_limit():
    made = _Made()
    slots = ClientSlots(made, limit=3)  # type: ignore[arg-type]
    got = [slots.take() for _ in range(3)]
    assert len(set(map(id, got))) == 3 and slots.made() == made.clients
    extra = [slots.take(), slots.take()]  # past the limit: the least busy are shared
    assert len(made.clients) == 3 and len(set(map(id, extra))) == 2
    assert slots.busy() == 5


def test_a_given_back_client_is_the_next_one_lent_and_a_shared_one_only_once_idle():
    made = _Made()
    slots = ClientSlots(made, limit=2)  # type: ignore[arg-type]
    a, b = slots.take(), slots.take()
    shared = slots.take()
    slots.give(b)
    assert slots.take() is b  # idle again, most recently used first
    slots.give(shared)  # still lent once more: not idle yet
    slots.give(b)
    slots.give(a)
    assert slots.take() is a and slots.take() is b and len(made.clients) == 2


def test_at_least_one_slot():
    with pytest.raises(ValueError):
        ClientSlots(_Made(), limit=0)  # type: ignore[arg-type]
