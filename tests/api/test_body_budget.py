"""The body budget (kvxferd.api.bodybudget) and BodyLimit's use of it, as pure asyncio and ASGI:
takes past the total wait, first come first served; a cancelled or timed-out waiter holds
nothing and lets the next in; BodyLimit takes an announced body before reading a byte of it,
answers 503 when no room comes within the body timeout, and gives every byte back however the
request ends. Real listeners: tests/api/test_http_edge.py, test_frame_limits.py, test_limits.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest

from kvxferd.api.bodybudget import BodyBudget
from kvxferd.api.limits import BodyLimit, Message
from kvxferd.errors import CapacityError
from kvxferd.wire import ErrorBody

BOUND_S = 10.0
"""Bound of every wait in these tests (a hang fails instead of stalling the run)."""


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), BOUND_S))


async def queued(budget: BodyBudget, n: int) -> None:
    """Let the loop run until ``n`` takes wait in ``budget`` (bounded by the caller's wait)."""
    while budget.waiting != n:
        await asyncio.sleep(0)  # one loop turn: the tasks started so far run to their wait


# ------------------------------------------------------------------------------ the budget


def test_a_take_past_the_total_waits_until_bytes_are_given_back():
    async def scenario() -> None:
        budget = BodyBudget(100)
        await budget.take(60)
        later = asyncio.create_task(budget.take(50))
        await queued(budget, 1)
        assert budget.taken == 60 and not later.done()
        budget.give(60)
        await later
        assert budget.taken == 50 and budget.waiting == 0

    run(scenario)


def test_waiters_are_served_in_order_so_a_large_body_is_not_starved_by_small_ones():
    async def scenario() -> None:
        budget = BodyBudget(100)
        await budget.take(60)
        order: list[str] = []

        async def take(name: str, n: int) -> None:
            await budget.take(n)
            order.append(name)

        large = asyncio.create_task(take("large", 80))
        await queued(budget, 1)
        small = asyncio.create_task(take("small", 30))  # 60 + 30 fit, but the large came first
        await queued(budget, 2)
        assert order == [] and budget.taken == 60
        budget.give(60)
        await large
        await queued(budget, 1)  # the small one still waits: 80 + 30 do not fit
        assert order == ["large"] and budget.taken == 80
        budget.give(80)
        await small
        assert order == ["large", "small"] and budget.taken == 30

    run(scenario)


@pytest.mark.parametrize("how", ["cancelled", "timed-out"])
def test_a_waiter_that_gives_up_holds_nothing_and_lets_the_next_one_in(how):
    async def scenario() -> None:
        budget = BodyBudget(100)
        await budget.take(60)

        async def bounded() -> None:
            async with asyncio.timeout(0.05 if how == "timed-out" else BOUND_S):
                await budget.take(80)

        large = asyncio.create_task(bounded())
        await queued(budget, 1)
        small = asyncio.create_task(budget.take(30))
        await queued(budget, 2)
        if how == "cancelled":
            large.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancelled" else TimeoutError):
            await large
        await small  # in without a byte given back: the large waiter ahead of it left
        assert budget.taken == 90 and budget.waiting == 0

    run(scenario)


def test_a_waiter_cancelled_after_its_bytes_were_granted_gives_them_back():
    async def scenario() -> None:
        budget = BodyBudget(100)
        await budget.take(100)
        later = asyncio.create_task(budget.take(50))
        await queued(budget, 1)
        budget.give(100)  # grants the 50 bytes; the waiter has not run yet
        later.cancel()
        with pytest.raises(asyncio.CancelledError):
            await later
        assert budget.taken == 0

    run(scenario)


def test_more_than_the_total_is_refused_at_once_and_the_budget_reports_each_change():
    seen: list[int] = []

    async def scenario() -> None:
        budget = BodyBudget(100, seen.append)
        with pytest.raises(CapacityError, match="^max_body_bytes_in_flight: a 101-byte body"):
            await budget.take(101)
        await budget.take(100)
        budget.give(100)
        with pytest.raises(ValueError, match="only 0 are taken"):
            budget.give(1)

    run(scenario)
    assert seen == [100, 0]


# ------------------------------------------------------------------------------ BodyLimit


class Request:
    """One request's ASGI side: its scope, the messages its client sends (fed to ``receive``
    as they are put), and what it was answered."""

    def __init__(self, content_length: int | None, *bodies: tuple[bytes, bool]) -> None:
        headers = [] if content_length is None else [(b"content-length", b"%d" % content_length)]
        self.scope = {"type": "http", "headers": headers}
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.sent: list[Message] = []
        for body, more in bodies:
            self.put(body, more)

    def put(self, body: bytes, more: bool = False) -> None:
        self.inbox.put_nowait({"type": "http.request", "body": body, "more_body": more})

    async def receive(self) -> Message:
        return await self.inbox.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None

    def error(self) -> ErrorBody:
        assert (b"connection", b"close") in self.sent[0]["headers"]
        return msgspec.json.decode(self.sent[1]["body"], type=ErrorBody)


class GatedApp:
    """Answers 200 with the body, once ``release`` is set; logs when each call starts and ends."""

    def __init__(self, fail: bool = False) -> None:
        self.release = asyncio.Event()
        self.log: list[str] = []
        self.fail = fail

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        self.log.append(f"start {len(body)}")
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the app failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})
        self.log.append(f"end {len(body)}")


def _limit(app: GatedApp, budget: BodyBudget, timeout_s: float = BOUND_S) -> BodyLimit:
    return BodyLimit(app, 1024, timeout_s, 4096, budget=budget)


def test_a_body_that_does_not_fit_waits_unread_until_the_first_request_has_answered():
    async def scenario() -> None:
        app, budget = GatedApp(), BodyBudget(1024)
        limit = _limit(app, budget)
        first = Request(1000, (b"a" * 1000, False))
        second = Request(100, (b"b" * 100, False))
        one = asyncio.create_task(limit(first.scope, first.receive, first.send))
        while app.log != ["start 1000"]:
            await asyncio.sleep(0)
        two = asyncio.create_task(limit(second.scope, second.receive, second.send))
        await queued(budget, 1)
        assert second.inbox.qsize() == 1  # not a byte of it read while it waits
        assert budget.taken == 1000
        app.release.set()
        await asyncio.gather(one, two)
        assert app.log == ["start 1000", "end 1000", "start 100", "end 100"]
        assert (first.status, second.status, budget.taken) == (200, 200, 0)

    run(scenario)


def test_a_chunked_body_takes_each_chunk_as_it_arrives():
    async def scenario() -> None:
        app, budget = GatedApp(), BodyBudget(1024)
        app.release.set()
        limit = _limit(app, budget)
        await budget.take(900)
        req = Request(None, (b"x" * 100, True))
        task = asyncio.create_task(limit(req.scope, req.receive, req.send))
        while req.inbox.qsize():
            await asyncio.sleep(0)
        req.put(b"y" * 100)  # 900 + 100 + 100 do not fit: this chunk waits for room
        await queued(budget, 1)
        assert budget.taken == 1000
        budget.give(900)
        await task
        assert (req.status, req.sent[1]["body"]) == (200, b"x" * 100 + b"y" * 100)
        assert budget.taken == 0

    run(scenario)


def test_a_body_that_finds_no_room_within_the_body_timeout_is_503_and_never_reaches_the_app():
    async def scenario() -> None:
        app, budget = GatedApp(), BodyBudget(1024)
        await budget.take(1024)  # held by another request
        req = Request(100, (b"z" * 100, False))
        await _limit(app, budget, timeout_s=0.1)(req.scope, req.receive, req.send)
        assert req.status == 503 and app.log == []
        error = req.error()
        assert error.error == "Busy" and "at most 1024 bytes" in error.detail
        assert (budget.taken, budget.waiting) == (1024, 0)

    run(scenario)


@pytest.mark.parametrize(
    ("case", "status", "peak"),
    [("413", 413, 1000), ("408", 408, 1000), ("disconnect", None, 1000),
     ("app-error", None, 1000), ("served", 200, 1000)],
)  # fmt: skip
def test_every_byte_goes_back_however_the_request_ends(case, status, peak):
    seen: list[int] = []

    async def scenario() -> None:
        app, budget = GatedApp(fail=case == "app-error"), BodyBudget(1024, seen.append)
        app.release.set()
        if case == "413":  # chunked, cut at the limit
            req = Request(None, (b"x" * 1000, True), (b"x" * 100, False))
        elif case == "408":  # announced, then stops arriving
            req = Request(1000, (b"x" * 10, True))
        elif case == "disconnect":
            req = Request(1000, (b"x" * 10, True))
            req.inbox.put_nowait({"type": "http.disconnect"})
        else:
            req = Request(1000, (b"x" * 1000, False))
        limit = _limit(app, budget, timeout_s=0.1)
        if case == "app-error":
            with pytest.raises(RuntimeError):
                await limit(req.scope, req.receive, req.send)
        else:
            await limit(req.scope, req.receive, req.send)
        assert req.status == status
        assert budget.taken == 0

    run(scenario)
    assert max(seen) == peak and seen[-1] == 0  # held while it was read, then all given back


def test_a_budget_smaller_than_one_body_is_refused_when_the_listener_is_built():
    with pytest.raises(ValueError, match="cannot hold one 1024-byte body"):
        _limit(GatedApp(), BodyBudget(1000))
