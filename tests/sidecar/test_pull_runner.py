"""PullRunner's bounds: at most ``max_in_flight`` pulls run at once (a refused pull leaves no row,
task or gauge behind), a pull's deadline is capped, and finished pulls are forgotten oldest first
past the keep count even while an older pull is still running, each keeping only its status.

Pure logic: the real runner before any READ, its peers a fake whose handshakes either fail at once
or wait until the test lets them go.
"""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvxferd.errors import BlockIdError, CapacityError, HandshakeError, UnknownPullError
from kvxferd.metrics import Metrics
from kvxferd.sidecar import pulls
from kvxferd.sidecar.pulls import PullRunner
from kvxferd.wire import PullRequest, Ticket
from tests.descriptors.layouts import hybrid_spec, num_groups, render

LOCAL = render(hybrid_spec(), 1, 0)
BOUND_S = 10.0
"""Bound of every wait here (a hang fails instead of stalling the run)."""


class Peers:
    """Handshakes to ``stuck:*`` wait for ``release``; any other peer fails at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0

    def cached(self, address: str, engine_id: str, epoch: int, generation: int = -1) -> None:
        return None

    async def get(self, address: str, engine_id: str, epoch: int, generation: int = -1) -> None:
        if not address.startswith("stuck"):
            raise HandshakeError(f"{address}: refused")
        self.waiting += 1
        await self.release.wait()
        raise HandshakeError(f"{address}: gone")

    async def forget(self, address: str) -> None:
        return None


def _runner(peers: Peers, **kw) -> tuple[PullRunner, Metrics]:
    metrics = Metrics(registry=CollectorRegistry())
    runner = PullRunner(
        local=lambda: (LOCAL, tuple(range(len(LOCAL.regions)))),
        transport=types.SimpleNamespace(name="decode"),  # type: ignore[arg-type]
        peers=peers,  # type: ignore[arg-type]
        metrics=metrics,
        **kw,
    )
    return runner, metrics


def _request(peer: str, deadline_s: float = 30.0) -> PullRequest:
    ids = [[g + 1] for g in range(num_groups(hybrid_spec()))]
    ticket = Ticket(engine_id="p", epoch=1, hold_id="h", request_id="r", block_ids=ids,
                    num_tokens=16, expires_at=0.0, tp_rank=0, tp_size=1, peer=peer)  # fmt: skip
    return PullRequest(tickets=[ticket], block_ids=ids, deadline_s=deadline_s)


async def _until(predicate, what: str) -> None:  # noqa: ANN001
    """Yield to the loop until ``predicate()`` holds, at most BOUND_S."""
    async with asyncio.timeout(BOUND_S):
        while not predicate():
            await asyncio.sleep(0)
    assert predicate(), what


def _in_flight(metrics: Metrics) -> float:
    return metrics.pulls_in_flight._value.get()


def test_a_pull_past_max_in_flight_is_refused_and_leaves_no_row_task_or_gauge():
    async def main() -> None:
        peers = Peers()
        runner, metrics = _runner(peers, max_in_flight=2)
        first = runner.start(_request("stuck:1"))
        runner.start(_request("stuck:2"))
        await _until(lambda: peers.waiting == 2, "both pulls handshaking")
        with pytest.raises(CapacityError) as err:
            runner.start(_request("stuck:3"))
        assert err.value.field == "max_pulls_in_flight" and err.value.status == 503
        assert (len(runner._pulls), len(runner._running), _in_flight(metrics)) == (2, 2, 2)
        peers.release.set()  # both end FAILED (handshake): room again
        await asyncio.wait_for(first.done.wait(), BOUND_S)
        await _until(lambda: _in_flight(metrics) == 0, "both pulls ended")
        third = runner.start(_request("stuck:3"))
        await asyncio.wait_for(third.done.wait(), BOUND_S)
        assert third.state.wire_name == "failed" and third.reason == "handshake"
        await runner.close()

    asyncio.run(main())


def test_a_deadline_longer_than_max_deadline_s_is_a_422_naming_deadline_s():
    async def main() -> None:
        runner, metrics = _runner(Peers(), max_deadline_s=60.0)
        with pytest.raises(BlockIdError) as err:
            runner.start(_request("stuck:1", deadline_s=1e9))
        assert err.value.field == "deadline_s"
        assert (len(runner._pulls), _in_flight(metrics)) == (0, 0)
        await runner.close()

    asyncio.run(main())


def test_finished_pulls_past_the_keep_count_are_forgotten_while_an_older_one_runs(monkeypatch):
    monkeypatch.setattr(pulls, "_KEEP_FINISHED", 2)

    async def main() -> None:
        peers = Peers()
        runner, _ = _runner(peers)
        running = runner.start(_request("stuck:1"))
        finished = []
        for i in range(5):
            pull = runner.start(_request(f"refused:{i}"))
            await asyncio.wait_for(pull.done.wait(), BOUND_S)
            finished.append(pull.pull_id)
        assert len(runner._pulls) == 3  # the running one and the two latest finished ones
        assert (await runner.status(running.pull_id, 0)).state == "handshaking"
        for pull_id in finished[-2:]:
            assert (await runner.status(pull_id, 0)).state == "failed"
        for pull_id in finished[:-2]:
            with pytest.raises(UnknownPullError):
                await runner.status(pull_id, 0)
        peers.release.set()
        await asyncio.wait_for(running.done.wait(), BOUND_S)
        await runner.close()

    asyncio.run(main())


def test_a_pull_cancelled_before_its_task_ran_still_ends_failed_and_frees_its_place():
    # An unregister (or shutdown) in the same loop turn as the pull's start cancels its task
    # before the coroutine runs a line: it must still end FAILED, reach the feed and leave the
    # in-flight count, or the cap fills with pulls that never end.
    async def main() -> None:
        runner, metrics = _runner(Peers(), max_in_flight=1)
        pull = runner.start(_request("stuck:1"))
        await runner.close()
        await asyncio.wait_for(pull.done.wait(), BOUND_S)
        assert (pull.state.wire_name, pull.reason) == ("failed", "cancelled")
        assert _in_flight(metrics) == 0
        assert [p.pull_id for p in runner.finished_since(0, 10).pulls] == [pull.pull_id]
        again = runner.start(_request("refused:1"))
        await asyncio.wait_for(again.done.wait(), BOUND_S)

    asyncio.run(main())


def test_a_finished_pull_keeps_its_status_and_feed_entry_but_not_its_request():
    # Thousands of finished pulls are kept for status queries: their block id lists are not.
    async def main() -> None:
        runner, _ = _runner(Peers())
        req = msgspec.structs.replace(_request("refused:1"), request_id="q")
        pull = runner.start(req)
        await asyncio.wait_for(pull.done.wait(), BOUND_S)
        assert (pull.request, pull.validated) == (None, None)
        assert (await runner.status(pull.pull_id, 0)).reason == "handshake"
        [entry] = runner.finished_since(0, 10).pulls
        assert entry.request_id == "q" and entry.failed_block_ids == req.block_ids
        await runner.close()

    asyncio.run(main())
