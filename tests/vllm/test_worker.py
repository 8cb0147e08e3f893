"""The worker side's declines: a step's declines go to the sidecar (from the worker's outbox
thread) in calls of at most MAX_TICKETS_PER_CALL tickets (the sidecar refuses a longer list),
every ticket once, in order, and a call that fails does not keep the others from being sent.
Its holds: one placed without an answer (it may be live, and claimed by a decode reading it) is
aborted, and its blocks are freed only when the released feed says so, or at once when the
sidecar does not know it. Its unregister: retried while refused for as long as a READ may still
touch the memory. Its pulls: one that ended unsettled, or whose sidecar stopped answering past
its end, keeps its blocks from vLLM for as long as a READ may still write them."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.client import SidecarError, SidecarUnreachableError
from kvxferd.errors import (
    HandshakeError,
    KvxferdError,
    MemoryInUseError,
    NotRegisteredError,
    UnknownHoldError,
)
from kvxferd.sidecar.reads import QUARANTINE_S
from kvxferd.vllm import worker as worker_module
from kvxferd.vllm.outbox import Outbox
from kvxferd.vllm.scheduler import Decline, HoldOrder, PullOrder, StepOrders
from kvxferd.vllm.worker import WorkerSide
from kvxferd.wire import (
    MAX_TICKETS_PER_CALL,
    DeclineRequest,
    DeclineResponse,
    ErrorBody,
    FinishedPull,
    FinishedPulls,
    HoldRequest,
    Identity,
    PullAccepted,
    PullRequest,
    ReleasedHold,
    ReleasedHolds,
    Ticket,
)
from tests.sidecar.harness import wait_until


class _Sidecar:
    """Stands in for the engine client: decodes each decline as the sidecar would (its wire
    bounds included) and fails the calls listed in ``fail``."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.calls: list[DeclineRequest] = []
        self.fail = fail

    def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        raw = msgspec.json.encode(DeclineRequest(tickets=tickets, reason=reason))
        self.calls.append(msgspec.json.decode(raw, type=DeclineRequest))
        if len(self.calls) - 1 in self.fail:
            raise HandshakeError("peer unreachable")
        return DeclineResponse(released=[t.hold_id for t in tickets], missing=[])

    def close(self) -> None:
        pass


def _declines(requests: int, ranks: int) -> list[Decline]:
    """One decline per request, each with one ticket per prefill rank."""
    return [
        Decline([msgspec.to_builtins(Ticket(
            engine_id="p", epoch=1, hold_id=f"h-{r}-{k}", request_id=f"r-{r}", block_ids=[[1]],
            num_tokens=16, expires_at=0.0, tp_rank=k, tp_size=ranks, peer="127.0.0.1:9",
        )) for k in range(ranks)], "aborted")
        for r in range(requests)
    ]  # fmt: skip


def _worker(sidecar: _Sidecar) -> WorkerSide:
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = sidecar  # type: ignore[assignment]
    worker._outbox = Outbox(lambda: sidecar, 30.0)  # type: ignore[arg-type]
    return worker


def test_a_step_with_more_declined_tickets_than_one_call_takes_sends_several_calls():
    sidecar = _Sidecar()
    declines = _declines(requests=MAX_TICKETS_PER_CALL // 8 + 1, ranks=8)  # a request too many
    worker = _worker(sidecar)
    worker.run(StepOrders(declines=declines))
    wait_until(lambda: len(sidecar.calls) == 2, 30, "the outbox's calls")
    worker._outbox.close()
    assert [len(c.tickets) for c in sidecar.calls] == [MAX_TICKETS_PER_CALL, 8]
    sent = [t.hold_id for c in sidecar.calls for t in c.tickets]
    assert sent == [t["hold_id"] for d in declines for t in d.tickets]


def test_a_failed_decline_call_does_not_keep_the_next_from_being_sent():
    sidecar = _Sidecar(fail=(0,))
    worker = _worker(sidecar)
    worker.run(StepOrders(declines=_declines(requests=MAX_TICKETS_PER_CALL, ranks=2)))
    wait_until(lambda: len(sidecar.calls) == 2, 30, "the outbox's calls")
    worker._outbox.close()
    assert [len(c.tickets) for c in sidecar.calls] == [MAX_TICKETS_PER_CALL] * 2


NO_ANSWER = SidecarUnreachableError("POST /v1/holds: no answer in time (30 s)")
UNREADABLE = SidecarError(200, ErrorBody(error="DecodeError", detail="unusable Ticket"))


class _Unanswered:
    """Stands in for the engine client of a sidecar whose hold calls raise ``error`` (by default
    no answer: the call timed out); ``placed`` says whether it placed the holds all the same.
    Its released feed lists what the test appends."""

    def __init__(self, placed: bool, error: KvxferdError = NO_ANSWER) -> None:
        self.placed = placed
        self.error = error
        self.aborted: list[str] = []
        self.feed: list[ReleasedHold] = []
        self.reachable = True

    def hold(self, req: HoldRequest) -> Ticket:
        raise self.error

    def abort(self, hold_id: str) -> None:
        if not self.reachable:
            raise SidecarUnreachableError("POST /v1/holds/abort: no answer in time (30 s)")
        self.aborted.append(hold_id)
        if not self.placed:
            raise UnknownHoldError(f"hold_id {hold_id!r}: no such hold")

    def released(self, cursor: int = 0, limit: int | None = None) -> ReleasedHolds:
        return ReleasedHolds(holds=self.feed[cursor:], cursor=len(self.feed))


def _placed_unanswered(sidecar: _Unanswered) -> WorkerSide:
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = sidecar  # type: ignore[assignment]
    worker.run(StepOrders(holds=[HoldOrder("r1", "h1", [[1, 2]], 32, [(1, 0)])]))
    return worker


@pytest.mark.parametrize("error", [NO_ANSWER, UNREADABLE], ids=["no-answer", "unreadable"])
def test_a_hold_placed_without_an_answer_is_aborted_and_freed_only_once_released(error):
    sidecar = _Unanswered(placed=True, error=error)
    sidecar.reachable = False
    worker = _placed_unanswered(sidecar)
    assert worker.finished() == (None, None)  # the abort got no answer either: kept, not freed
    sidecar.reachable = True
    assert worker.finished() == (None, None)  # aborted; a decode may still be reading it
    assert sidecar.aborted == ["h1"]
    assert worker.finished() == (None, None)
    assert sidecar.aborted == ["h1"]  # given up once
    sidecar.feed.append(ReleasedHold(hold_id="h1", request_id="r1", block_ids=[[1, 2]],
                                     reason="aborted"))  # fmt: skip
    assert worker.finished() == ({"r1"}, None)
    assert worker.finished() == (None, None)  # freed once


@pytest.mark.parametrize("released_first", [False, True], ids=["unknown", "released-first"])
def test_a_hold_placed_without_an_answer_that_the_sidecar_does_not_know_is_freed(released_first):
    sidecar = _Unanswered(placed=False)
    worker = _placed_unanswered(sidecar)
    if released_first:  # placed after all, and released (declined) before the abort
        sidecar.feed.append(ReleasedHold(hold_id="h1", request_id="r1", block_ids=[[1, 2]],
                                         reason="declined"))  # fmt: skip
    assert worker.finished() == ({"r1"}, None)
    assert worker.finished() == (None, None)  # freed once


def test_a_hold_the_sidecar_refused_is_freed_at_once_without_an_abort():
    refusal = SidecarError(422, ErrorBody(error="ValidationError", detail="request_id: too long"))
    sidecar = _Unanswered(placed=False, error=refusal)
    worker = _placed_unanswered(sidecar)
    assert worker.finished() == ({"r1"}, None)
    assert sidecar.aborted == []


class _Clock:
    """Stands in for the worker's ``time``: sleeping moves it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Unsettled:
    """Refuses an unregister while a READ stays unsettled: until ``clock`` reaches ``until``."""

    def __init__(self, clock: _Clock, until: float) -> None:
        self.clock, self.until, self.calls = clock, until, 0

    def unregister(self, generation: int) -> None:
        self.calls += 1
        if self.clock.now < self.until:
            raise MemoryInUseError("unregister: 1 READs still unsettled may write this memory")


@pytest.mark.parametrize("accepted", [True, False], ids=["settles", "never"])
def test_an_unregister_refused_for_an_unsettled_read_is_retried_as_long_as_it_may_write(
    monkeypatch, accepted
):
    """A READ that could not be confirmed stopped stays quarantined (may still write) for up to
    QUARANTINE_S, longer than any claim: sleep retries that long before it lets memory go."""
    clock = _Clock()
    monkeypatch.setattr(worker_module, "time", clock)
    until = QUARANTINE_S - 1.0 if accepted else float("inf")
    sidecar = _Unsettled(clock, until)
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = sidecar  # type: ignore[assignment]
    if accepted:
        worker._unregister(0, max_claim_s=120.0)
        assert clock.now >= until
    else:
        with pytest.raises(MemoryInUseError):
            worker._unregister(0, max_claim_s=120.0)
        assert QUARANTINE_S <= clock.now <= QUARANTINE_S + 60.0  # bounded all the same
    assert sidecar.calls > 1


class _UnsettledPull:
    """Stands in for the engine client: accepts pulls and reports each ended as ``reason``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.feed: list[FinishedPull] = []

    def pull(self, req: PullRequest) -> PullAccepted:
        self.feed.append(FinishedPull(pull_id=f"p{len(self.feed)}", request_id=req.request_id,
                                      state="failed", reason=self.reason,
                                      failed_block_ids=req.block_ids))  # fmt: skip
        return PullAccepted(pull_id=f"p{len(self.feed) - 1}")

    def finished_pulls(self, cursor: int = 0, limit: int | None = None) -> FinishedPulls:
        return FinishedPulls(pulls=self.feed[cursor:], cursor=len(self.feed))


@pytest.mark.parametrize("reason", ["unsettled", "claim_expired"])
def test_a_pull_that_ended_unsettled_keeps_its_blocks_from_vllm_while_its_read_may_write(
    monkeypatch, reason
):
    """vLLM recomputes into a failed pull's blocks (load errors) and reuses them once the request
    ends: a READ that could not be confirmed stopped may still write them until the sidecar
    gives it up (QUARANTINE_S), so until then the request is not reported ended."""
    clock = _Clock()
    monkeypatch.setattr(worker_module, "time", clock)
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = _UnsettledPull(reason)  # type: ignore[assignment]
    worker.run(StepOrders(pulls=[PullOrder("d1", [], [[4, 5, -1]], 48)]))
    if reason != "unsettled":  # any other failure: nothing can write, recomputed at once
        assert worker.finished() == (None, {"d1"}) and worker.load_errors() == {4, 5}
        return
    assert worker.finished() == (None, None) and worker.load_errors() == set()
    clock.sleep(QUARANTINE_S - 1.0)
    assert worker.finished() == (None, None) and worker.load_errors() == set()
    clock.sleep(1.0)
    assert worker.finished() == (None, {"d1"}) and worker.load_errors() == {4, 5}
    assert worker.finished() == (None, None)  # reported once


class _SilentPulls(_UnsettledPull):
    """Accepts pulls whose end its feed never lists; ``reachable`` says whether it answers."""

    reachable = False

    def finished_pulls(self, cursor: int = 0, limit: int | None = None) -> FinishedPulls:
        if not self.reachable:
            raise SidecarUnreachableError("GET /v1/pulls/finished: no answer in time (30 s)")
        return FinishedPulls(pulls=[], cursor=0)


@pytest.mark.parametrize("answers", [True, False], ids=["restarted", "hung"])
def test_a_pull_past_its_end_is_given_up_at_once_only_when_its_sidecar_answers(
    monkeypatch, answers
):
    """A sidecar that answers its feed without a pull past its end lost it with a restart (its
    READs went with the old process). One that does not answer may be hung with a READ that can
    still write: the pull's blocks wait as long as a quarantined READ's."""
    clock = _Clock()
    monkeypatch.setattr(worker_module, "time", clock)
    sidecar = _SilentPulls("")
    sidecar.reachable = answers
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = sidecar  # type: ignore[assignment]
    worker.run(StepOrders(pulls=[PullOrder("d1", [], [[4, 5]], 32)]))
    clock.sleep(120.0)  # past its deadline (30 s) and every settling allowance
    if not answers:
        assert worker.finished() == (None, None) and worker.load_errors() == set()
        clock.sleep(QUARANTINE_S)
    assert worker.finished() == (None, {"d1"}) and worker.load_errors() == {4, 5}
    assert worker.finished() == (None, None)


class _Restarted(_UnsettledPull):
    """Its first pull ends unsettled; then its process restarts (a new epoch) or an operator's
    unregister ends behind the engine (``epoch`` unchanged, nothing registered)."""

    def __init__(self, epoch: int) -> None:
        super().__init__("unsettled")
        self.epoch = epoch

    def pull(self, req: PullRequest) -> PullAccepted:
        if self.feed:
            raise NotRegisteredError("pull: no engine is registered")
        return super().pull(req)

    def identity(self) -> Identity:
        return Identity(engine_id="e", epoch=self.epoch, generation=-1, peer_address="h:1",
                        tp_rank=-1, tp_size=0, default_lease_s=30.0)  # fmt: skip


@pytest.mark.parametrize("epoch", [8, 7], ids=["restarted", "unregistered"])
def test_a_pull_set_aside_unsettled_is_freed_once_its_registration_is_gone(monkeypatch, epoch):
    """Its READ went with the old process (one sidecar per socket), or the unregister that
    ended waited for every unsettled READ: nothing can write its blocks any more."""
    clock = _Clock()
    monkeypatch.setattr(worker_module, "time", clock)
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = _Restarted(epoch)  # type: ignore[assignment]
    worker.epoch, worker._registration = 7, ("caches",)  # type: ignore[assignment]
    registered: list[tuple[object, ...]] = []
    monkeypatch.setattr(worker, "register", lambda *args: registered.append(args))
    worker.run(StepOrders(pulls=[PullOrder("d1", [], [[4, 5]], 32)]))
    assert worker.finished() == (None, None)  # set aside: its READ may still write
    worker.run(StepOrders(pulls=[PullOrder("d2", [], [[6]], 16)]))  # refused: not registered
    assert registered == [("caches",)]
    assert worker.finished() == (None, {"d1", "d2"}) and worker.load_errors() == {4, 5, 6}


class _Unregistering:
    """An operator's unregister of the engine ``instance``'s registration (generation 3) runs
    behind it: calls are refused, identity unchanged."""

    def __init__(self, instance: str) -> None:
        self.instance = instance

    def released(self, cursor: int = 0, limit: int | None = None) -> object:
        raise NotRegisteredError("the engine is unregistering: its memory is being let go")

    def identity(self) -> Identity:
        return Identity(engine_id="e", epoch=7, generation=3, peer_address="h:1",
                        tp_rank=0, tp_size=1, default_lease_s=30.0,
                        instance=self.instance)  # fmt: skip


def test_waiting_for_an_unregister_behind_the_engine_is_logged_seldom_and_frees_nothing(
    monkeypatch, caplog
):
    """The worker asks at every step (vLLM steps many times a second); one line per
    _WAITING_LOG_S says it waits, and its hold's blocks stay held."""
    clock = _Clock()
    monkeypatch.setattr(worker_module, "time", clock)
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = _Unregistering(worker.instance)  # type: ignore[assignment]
    worker.epoch, worker.generation = 7, 3
    worker._registration = ("caches",)  # type: ignore[assignment]
    worker._holds["r1"] = "h1"
    caplog.set_level("INFO", logger=worker_module.__name__)
    for _ in range(600):  # a minute of steps, 10 a second
        assert worker.finished() == (None, None)
        clock.sleep(0.1)
    waits = [r for r in caplog.records if "letting its memory go; waiting" in r.message]
    assert len(waits) == 2
