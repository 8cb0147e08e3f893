"""The worker side of the connector: one kvxferd sidecar per rank (or one pod sidecar every rank
of the engine shares, kvxferd.vllm.pod), driven over the engine API.

Registers vLLM's one backing allocation as many regions (a POSIX shared-memory segment on CPU,
a CUDA IPC handle on GPU), places the holds the scheduler minted, starts the pulls, sends
declines, and turns the sidecar's finished-pulls and released-holds feeds into vLLM's per-step
``get_finished`` answer (one local call per feed per step, only while something is outstanding).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvxferd import __version__
from kvxferd.api.sockets import hold_lock
from kvxferd.client import EngineClient, frames_available
from kvxferd.errors import (
    AlreadyRegisteredError,
    ConfigError,
    KvxferdError,
    MemoryInUseError,
    NotRegisteredError,
    PathInUseError,
    RegisterInProgressError,
    StaleGenerationError,
    UnknownHoldError,
)
from kvxferd.sidecar.reads import QUARANTINE_S, SETTLE_S
from kvxferd.vllm.manifest import ConvGeometry, describe
from kvxferd.vllm.outbox import Outbox
from kvxferd.vllm.pod import check_identity
from kvxferd.vllm.quiet import QuietClient, no_answer, placed_maybe
from kvxferd.vllm.scheduler import KEEPALIVE_EXTEND_S, StepOrders
from kvxferd.vllm.storeio import StoreCalls
from kvxferd.wire import (
    ENGINE_API_VERSION,
    HoldRequest,
    PullRequest,
    Ticket,
)

log = logging.getLogger(__name__)

_MAX_PAGES = 64  # feed pages read per step (each bounded by the sidecar); the rest next step
_PULL_SLACK_S = SETTLE_S + 5.0  # past its deadline, a pull the feed never reported was lost
_UNREGISTER_SLACK_S = 10.0
"""Sleep and re-registration retry an unregister the sidecar refuses because a decode may still
READ the memory (or a READ write it) for the sidecar's longest claim, or the longest an unsettled
READ stays quarantined if that is longer, plus this."""
_UNANSWERED = "?"  # + request id: a pull whose start got no answer (its id unknown)
_WAITING_LOG_S = 30.0  # at most one line this often for a state asked every step (_tell)
_REGISTER_WAIT_S = 30.0  # longest a register waits for another one the sidecar still sets up
_REGISTER_PAUSES_S = (0.05, 1.0)  # first and longest pause between those tries (doubling)
REGISTER_RETRY_S = 120.0
"""Longest an engine's start or wake-up tries again a register (or identity) call that got no
answer (timed out, or a 5xx: a pod's other ranks not there in time), from its first try."""


@dataclass
class _Pull:
    """A pull this worker started: whose, which local blocks, when the sidecar must end it."""

    request_id: str
    block_ids: list[list[int]]
    ends_by: float


class WorkerSide:
    """One rank's connector state: its sidecar client, pulls in flight, the released cursor."""

    def __init__(
        self,
        socket_path: str,
        *,
        model: str,
        tp_rank: int,
        tp_size: int,
        conv: ConvGeometry | None = None,
        pod: bool = False,
        instance: str | None = None,
    ) -> None:
        # Frames when the sidecar serves them as this worker starts (else HTTP for its life).
        self.socket_path = socket_path
        self._sidecar = QuietClient(EngineClient(socket_path, frames=frames_available(socket_path)))
        self.client: Any = self._sidecar  # calls held back a while after one got no answer
        self._outbox = Outbox(
            lambda: EngineClient(socket_path, frames=frames_available(socket_path)),
            KEEPALIVE_EXTEND_S,
        )  # its own thread and connection: a decline or keepalive waits for every prefill
        self.model, self.tp_rank, self.tp_size = model, tp_rank, tp_size
        self.conv = conv  # how Mamba/GDN conv states are laid out (None: one shard per rank)
        self.generation = -1  # sent with every hold, pull and store call: the sidecar checks it
        self.epoch = -1  # the sidecar's boot epoch at our registration
        self.pod = pod  # the engine's ranks share this sidecar (a pod's): holds name our rank
        # this engine's own id, told apart from another's (a pod's workers share one)
        self.instance = instance or uuid.uuid4().hex
        self._lock: int | None = None  # fd holding <sidecar_socket>.engine.lock, once taken
        self._given_up_to: str | None = None  # instance ("": none named) it left the sidecar to
        self.manifest: Any = None  # what was registered (offsets from the segment start)
        self._pulls: dict[str, _Pull] = {}  # by pull id
        self._registration: tuple[Any, Any, int] | None = None  # what register() was given
        self._holds: dict[str, str] = {}  # request id -> hold id
        self._cursor = 0  # released-holds feed
        self._pull_cursor = 0  # finished-pulls feed
        self._stale = False  # a minted ticket named another epoch/generation than our sidecar
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()  # requests of failed loads since take_failed
        self._ipc: Any = None  # the exported CUDA IPC region, kept open while registered
        self._refused: set[str] = set()  # pulls the sidecar refused: finished, with errors
        # request id -> (when, its blocks per group): a pull that ended unsettled, failed (_fail)
        # only once its READ can no longer write them
        self._aside: dict[str, tuple[float, list[list[int]]]] = {}
        self._waiting_told = -_WAITING_LOG_S  # when _tell last logged
        self._unheld: set[str] = set()  # holds the sidecar refused: free the blocks at once
        self._unanswered: dict[str, str] = {}  # request id -> hold id placed with no answer
        self.store = StoreCalls(self.client, lambda: self.generation, tp_rank if pod else -1)
        self.asleep = False  # unregistered for vLLM's sleep mode until restore()

    def register(self, kv_caches: dict[str, Any], kv_cache_config: Any, total_heads: int, *,
                 no_answer_s: float = 0.0) -> None:  # fmt: skip
        """Describe the allocation and register it; a sidecar left registered by an earlier
        engine is unregistered first (a restarted engine beside a running sidecar). While the
        sidecar still sets up another engine's register, try again (bounded): that one may end
        registered, so each try reads the identity and decides afresh. A call that got no
        answer is tried again for up to ``no_answer_s`` (logged): a pod answers the same
        register repeated as that register, a one-rank sidecar's identity names it if it
        was taken (replaced then, as at any start)."""
        self._registration = (kv_caches, kv_cache_config, total_heads)
        self._close_ipc()  # an earlier export names memory that may since have moved
        manifest, source, self._ipc = describe(
            kv_caches, kv_cache_config, total_heads, model=self.model, tp_rank=self.tp_rank,
            tp_size=self.tp_size, conv=self.conv,
        )  # fmt: skip
        start = time.monotonic()
        deadline, pause = start + _REGISTER_WAIT_S, _REGISTER_PAUSES_S[0]
        took: bool | None = None  # whether this call took the engine lock (None: not tried)
        taken_maybe = False  # a register of ours got no answer: the sidecar may have taken it
        retry = _REGISTER_PAUSES_S[0]  # pause before trying a call that got no answer again
        while True:
            sent = False
            try:
                # A pod answers our register repeated with the pod's answer: not unregistered
                # (that would take every rank's memory from under them).
                if not (self.pod and taken_maybe):
                    ident = self.client.identity()
                    if not self._may_register(ident):
                        return
                    if took is None:
                        took = self._lock is None and self._lock_sidecar()
                    if ident.generation >= 0:
                        self._replace(ident, took)
                sent = True
                resp = self.client.register(manifest, [source], instance=self.instance)
                break
            except RegisterInProgressError as exc:  # transient, unlike an engine registered
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AlreadyRegisteredError(
                        f"sidecar at {self.socket_path}: another engine's register was still in "
                        f"progress after {_REGISTER_WAIT_S:g} s (is the sidecar hung? restart "
                        "it, then this engine)"
                    ) from exc
                if pause == _REGISTER_PAUSES_S[0]:  # its first refusal
                    log.info("sidecar at %s: another engine's register is in progress; "
                             "trying again for up to %g s", self.socket_path,
                             _REGISTER_WAIT_S)  # fmt: skip
                time.sleep(min(pause, left))  # a retry's backoff
                pause = min(2 * pause, _REGISTER_PAUSES_S[1])
            except AlreadyRegisteredError:  # (a one-rank sidecar) ours, taken after no answer?
                if not taken_maybe or time.monotonic() - start >= no_answer_s:
                    raise  # else the identity names it, replaced as at any start
            except KvxferdError as exc:
                if not no_answer(exc):
                    raise
                left = no_answer_s - (time.monotonic() - start)
                if left <= 0:
                    raise
                taken_maybe = taken_maybe or sent
                deadline = max(deadline, time.monotonic() + _REGISTER_WAIT_S)  # ours may be it
                log.warning("sidecar at %s: %s got no answer (%s); trying again for up to "
                            "%.0f s", self.socket_path, "register" if sent else "identity",
                            exc, left)  # fmt: skip
                time.sleep(min(retry, left))
                retry = min(2 * retry, _REGISTER_PAUSES_S[1])
        self._given_up_to = None
        self.manifest = manifest
        self.generation, self.epoch = resp.generation, resp.epoch
        self._cursor = 0  # each registration's released-holds feed counts from the start
        self._stale = True  # a new generation: tickets minted before it can no longer be claimed

    def _replace(self, ident: Any, took: bool) -> None:
        """Unregister the registration ``ident`` names, so that this engine's takes its place."""
        if ident.instance not in ("", self.instance) and not took:
            # Unless this engine took the engine lock just now (the engine registered there
            # has exited), that engine runs without the lock and may be live.
            log.warning("sidecar at %s: replacing the registration of another engine of TP "
                        "rank %d (instance %s); if that engine still runs, it shares this "
                        "sidecar and its KV transfers stop", self.socket_path, ident.tp_rank,
                        ident.instance)  # fmt: skip
        self._unregister(ident.generation, ident.max_claim_s)

    def _may_register(self, ident: Any) -> bool:
        """Whether this engine may register at the sidecar that answered ``ident``: ConfigError
        if it never can, False while the engine it gave the sidecar up to is registered."""
        if ident.engine_api_version != ENGINE_API_VERSION:
            # The engine and sidecar images carry kvxferd separately: say so, not a 422 later.
            theirs = f"kvxferd {ident.kvxferd_version}" if ident.kvxferd_version else (
                "a kvxferd from before engine API versions")  # fmt: skip
            raise ConfigError(
                f"sidecar at {self.socket_path} speaks engine API {ident.engine_api_version} "
                f"({theirs}), this connector {ENGINE_API_VERSION} (kvxferd {__version__}): run "
                "one kvxferd release in the engine and sidecar images"
            )
        check_identity(ident, self.socket_path, self.pod, self.tp_size)
        if ident.generation >= 0 and ident.tp_rank != self.tp_rank and not self.pod:
            # Not an earlier engine of this rank: another rank's live registration, which an
            # unregister would take from under it (ranks sharing one socket).
            raise ConfigError(
                f"sidecar at {self.socket_path} is registered by TP rank "
                f"{ident.tp_rank}, not this rank {self.tp_rank}: each rank needs its own "
                "sidecar ({rank} in sidecar_socket)"
            )
        if ident.generation >= 0 and ident.instance == self._given_up_to:
            # The engine this one left the sidecar to (vLLM's wake-up, or a first start after
            # a sidecar restart) is still registered: taking it back, the two would keep
            # unregistering each other. Our calls are refused until it has gone.
            self._tell(f"sidecar at {self.socket_path} is still registered by another engine "
                       f"(instance {ident.instance or 'none'}): not taking it back; KV transfers "
                       "of this one stay off until it unregisters", error=True)  # fmt: skip
            return False
        return True

    def _lock_sidecar(self) -> bool:
        """Hold ``<sidecar_socket>.engine.lock`` (a pod's: ``.engine.lock.<rank>``) for this
        process's life (whether it is held now): a second engine given the same sidecar is
        refused at start (PathInUseError), while one restarted after its predecessor exited
        finds it free. Where the engine may not make that file, it goes on unlocked: the
        registration generation still keeps two engines' memory apart."""
        try:
            lock = self.socket_path + ".engine.lock" + (f".{self.tp_rank}" if self.pod else "")
            self._lock = hold_lock(lock, "sidecar_socket",
                                   f"{self.socket_path} is in use by another engine")  # fmt: skip
        except PathInUseError:
            raise
        except ConfigError as exc:
            log.warning("%s: a second engine on this sidecar is not refused at start", exc)
        return self._lock is not None

    def unregister(self) -> None:
        """vLLM's sleep (or discard): drop the registration so the sidecar no longer reads or
        writes this memory. Pulls still running end FAILED (their blocks become load errors),
        holds end (their blocks are freed); tickets minted so far are refused from now on.
        Idempotent; ``restore`` registers again."""
        if self.asleep or self._registration is None:
            return
        self.asleep = True
        try:
            if self.generation >= 0:
                self._unregister(self.generation, self.client.identity().max_claim_s)
        except KvxferdError as exc:  # e.g. the sidecar restarted: nothing is registered there
            log.warning("unregister for sleep failed: %s", exc)
        self.generation = -1
        for pull_id in list(self._pulls):
            self._lose(pull_id)
        self._unheld.update(self._holds)
        self._holds.clear()
        self._close_ipc()

    def _unregister(self, generation: int, max_claim_s: float) -> None:
        """Unregister ``generation``, retrying (bounded by the sidecar's longest claim, or the
        longest an unsettled READ is quarantined) while it refuses because a decode that claimed
        a hold may still READ this memory, or a READ may still write it: it must not be reused
        under that READ. A pod's: refused because another rank unregisters it, it returns once
        that has ended (this rank's memory stays registered until then)."""
        deadline = time.monotonic() + max(max_claim_s, QUARANTINE_S) + _UNREGISTER_SLACK_S
        while True:
            try:
                return self.client.unregister(generation)
            except MemoryInUseError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.info("unregister waits: %s", exc)
                time.sleep(1.0)  # a refusal for a read waited a few seconds already
            except (NotRegisteredError, StaleGenerationError):
                if not self.pod:
                    raise
                if self.client.identity().generation != generation:
                    return  # another rank's unregister ended it
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)  # another rank's unregister is letting the pod go

    def restore(self) -> None:
        """vLLM's wake-up: register the same tensors again (a new generation; the scheduler
        re-reads identities before minting the next ticket). Idempotent."""
        if not self.asleep or self._registration is None:
            return
        self.register(*self._registration, no_answer_s=REGISTER_RETRY_S)
        self.asleep = False

    def run(self, orders: StepOrders) -> None:
        """Save finished requests to the store (first: their blocks are free now), place this
        step's holds, start its pulls, send its declines, load from the store."""
        self.store.save(orders.saves)
        for h in orders.holds:
            try:
                placed = self.client.hold(
                    HoldRequest(
                        request_id=h.request_id,
                        block_ids=h.block_ids,
                        num_tokens=h.num_tokens,
                        hold_id=h.hold_id,
                        generation=self.generation,
                        tp_rank=self.tp_rank if self.pod else -1,
                    )
                )
            except KvxferdError as exc:
                if placed_maybe(exc):  # a decode may claim it: freed once the feed says so
                    log.warning("hold for %.200r got no answer (%s); giving it up",
                                h.request_id, exc)  # fmt: skip
                    self._holds[h.request_id] = h.hold_id
                    self._unanswered[h.request_id] = h.hold_id
                    continue
                # refused: no hold, so nobody can read; free the blocks now
                log.warning("hold for %.200r refused: %s", h.request_id, exc)
                self._unheld.add(h.request_id)
                if isinstance(exc, (NotRegisteredError, StaleGenerationError)):
                    self._recover()
                continue
            rank = 0 if self.pod else self.tp_rank  # a pod's one ticket
            minted = h.minted[rank] if len(h.minted) > rank else None
            if minted is not None and minted != (placed.epoch, placed.generation):
                # The ticket names an epoch/generation this sidecar no longer has: no claim can
                # match it, so give the hold up now and have the scheduler re-read identities.
                log.warning("ticket for %.200r is stale (sidecar restarted or re-registered)",
                            h.request_id)  # fmt: skip
                self._stale = True
                self._give_up(h.hold_id)
                self._unheld.add(h.request_id)
                continue
            self._holds[h.request_id] = h.hold_id
        for p in orders.failed:
            self._fail(p.request_id, p.block_ids)
        for p in orders.pulls:
            tickets = [Ticket(**t) for t in p.tickets]
            req = PullRequest(
                tickets=tickets,
                block_ids=p.block_ids,
                request_id=p.request_id,
                num_tokens=p.num_tokens,
                generation=self.generation,
            )
            try:
                pull_id = self.client.pull(req).pull_id
            except KvxferdError as exc:
                if not placed_maybe(exc):  # refused: vLLM recomputes these blocks
                    log.warning("pull for %.200r refused: %s", p.request_id, exc)
                    self._fail(p.request_id, p.block_ids)
                    if isinstance(exc, (NotRegisteredError, StaleGenerationError)):
                        self._recover()
                    continue
                # It may run all the same, its READ writing the blocks: the feed says how it ends
                log.warning("pull for %.200r got no answer: %s", p.request_id, exc)
                pull_id = _UNANSWERED + p.request_id
            ends_by = time.monotonic() + req.deadline_s + _PULL_SLACK_S
            self._pulls[pull_id] = _Pull(p.request_id, p.block_ids, ends_by)
        if self.tp_rank == 0:  # one decline or keepalive covers every prefill rank
            self._outbox.decline(orders.declines)
            self._outbox.keepalive(orders.keepalives)
        self.store.load(orders.loads)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose holds ended, requests whose pulls ended) since the last step: one
        read of each feed, and only while a pull or a hold is outstanding."""
        recving, self._refused = self._refused, set()
        read_all = False  # the feed was read to its end: a pull not in it went with a restart
        for _ in range(_MAX_PAGES if self._pulls and not self._sidecar.quiet else 0):
            try:
                page = self.client.finished_pulls(self._pull_cursor)
            except KvxferdError as exc:  # sidecar unreachable: ask again next step
                log.warning("finished-pulls feed unavailable: %s", exc)
                break
            self._pull_cursor, read_all = page.cursor, not page.more
            for f in page.pulls:
                pull = self._pulls.pop(f.pull_id, None) or self._pulls.pop(
                    _UNANSWERED + f.request_id, None)  # fmt: skip
                if pull is None:
                    continue  # another engine's pull, or one before a restart
                if f.reason == "unsettled":  # vLLM would recompute into blocks a READ may write
                    log.error("pull for %.200r ended unsettled: its blocks are set aside for %g s",
                              pull.request_id, QUARANTINE_S)  # fmt: skip
                    self._aside[pull.request_id] = (
                        time.monotonic() + QUARANTINE_S, f.failed_block_ids
                    )  # fmt: skip
                    continue
                if f.state != "done" or f.failed_block_ids:
                    self._fail(pull.request_id, f.failed_block_ids)
                else:
                    recving.add(pull.request_id)
            if not page.more or not self._pulls:
                break
        now = time.monotonic()
        for request_id, (until, block_ids) in list(self._aside.items()):
            if until <= now:  # the sidecar has given that READ up: the blocks are vLLM's again
                del self._aside[request_id]
                self._fail(request_id, block_ids)
        for pull_id, p in list(self._pulls.items()):
            # The sidecar ends every pull by then: one its feed does not list went with a
            # restarted sidecar. A sidecar that does not answer may be hung, not gone, with a
            # READ that may still write: its blocks wait as long as a quarantined READ's.
            if p.ends_by < now and (read_all or p.ends_by + QUARANTINE_S < now):
                self._lose(pull_id)
        recving |= self._refused
        self._refused = set()
        self._give_up_unanswered()
        sending, self._unheld = self._unheld, set()
        for _ in range(_MAX_PAGES if self._holds and not self._sidecar.quiet else 0):
            try:
                feed = self.client.released(self._cursor)
            except NotRegisteredError:  # the sidecar restarted: its holds went with it
                self._recover()
                break
            except KvxferdError as exc:  # sidecar unreachable: ask again next step
                log.warning("released-holds feed unavailable: %s", exc)
                break
            self._cursor = feed.cursor
            for rel in feed.holds:
                if self._holds.pop(rel.request_id, None) is not None:
                    sending.add(rel.request_id)
            if not feed.more or not self._holds:
                break
        sending |= self._unheld
        self._unheld = set()
        recving |= self._refused
        self._refused = set()
        recving |= self.store.take_done()
        return sending or None, recving or None

    def _give_up_unanswered(self) -> None:
        """Abort each hold whose placement got no answer: the sidecar may have placed it and a
        decode claimed it, so its blocks are freed only when the released feed says (an abort
        waits for a claimed reader). One the sidecar does not know was never placed (or was
        released already): freed now. Asked again next step while the sidecar does not answer."""
        for request_id, hold_id in list(
            self._unanswered.items() if not self._sidecar.quiet else ()
        ):
            if self._holds.get(request_id) != hold_id:  # the feed released it meanwhile
                del self._unanswered[request_id]
                continue
            try:
                self.client.abort(hold_id)
            except UnknownHoldError:
                del self._holds[request_id]
                self._unheld.add(request_id)
            except NotRegisteredError:  # the sidecar restarted: its holds went with it
                self._recover()
                return
            except KvxferdError as exc:
                log.warning("abort of unanswered hold %s failed (asked again): %s", hold_id, exc)
                continue
            del self._unanswered[request_id]

    def _lose(self, pull_id: str) -> None:
        """A pull the sidecar no longer knows: finished, every block a load error."""
        pull = self._pulls.pop(pull_id)
        log.warning("pull %s for %.200r was lost (sidecar restarted?)", pull_id, pull.request_id)
        self._fail(pull.request_id, pull.block_ids)

    def _fail(self, request_id: str, block_ids: list[list[int]]) -> None:
        """A load that ended without its bytes: reported ended, every block a load error."""
        self._load_errors.update(b for g in block_ids for b in g if b >= 0)
        self._failed.add(request_id)
        self._refused.add(request_id)

    def _recover(self) -> None:
        """The sidecar refused this engine as not registered, or as naming another registration:
        if it restarted beside this running engine, or an operator's unregister behind it has
        ended, give up what the old registration held or pulled, register again, and have the
        scheduler re-read identities. While that unregister still runs, nothing is given up: a
        decode may still READ a claimed hold, and a stopping pull's READ may still write (their
        blocks must not be reused yet). Another engine registered there since: give up the same,
        but do not take the sidecar back (each would keep unregistering the other)."""
        if self._registration is None or self.asleep:  # asleep: restore() registers
            return
        try:
            ident = self.client.identity()
        except KvxferdError as exc:  # cannot tell what the sidecar has: ask at the next refusal
            log.warning("sidecar refused this engine and cannot say why: %s", exc)
            return
        if ident.generation >= 0 and ident.instance != self.instance:
            # Another engine registered there (ours always name our instance; a tool's or the
            # simulator's name none): in this epoch after our registration's unregister had
            # ended, in a new one after the sidecar restarted (its old process exited). Either
            # way no READ of ours can still write, and what we held or pulled went with it.
            # Ours is forgotten all the same: no call of ours may name a registration again.
            self._give_up_registration()
            self._given_up_to = ident.instance
            self._tell(
                f"sidecar at {self.socket_path} is registered by another engine (instance "
                f"{ident.instance or 'none'}): KV transfers of this one are off until it "
                "unregisters; give each engine its own sidecar",
                error=True,
            )
            return
        if ident.epoch == self.epoch and ident.generation >= 0:
            if ident.instance == self.instance and ident.generation != self.generation:
                log.warning("adopting registration generation %d (its answer was lost)",
                            ident.generation)  # fmt: skip
                self.generation, self._stale = ident.generation, True
                return
            # Registered and refusing: an unregister behind this engine is letting the memory go.
            self._tell("an unregister behind this engine is letting its memory go; waiting")
            return
        log.warning("sidecar lost this engine's registration (restarted or unregistered behind "
                    "it); registering again")  # fmt: skip
        # The old registration's READs can no longer write: an unregister ends only once none
        # is unsettled, and a new epoch means the old process has exited (one sidecar per
        # socket: its lock goes only with its process).
        self._give_up_registration()
        try:
            self.register(*self._registration)  # inside a step: no answer is not waited out
        except KvxferdError as exc:  # still down: the next refused call tries again
            log.warning("registering again failed: %s", exc)

    def _give_up_registration(self) -> None:
        """The registration is gone, and none of its READs can write any more: every pull and
        hold it had has ended (their blocks: load errors and freed)."""
        for pull_id in list(self._pulls):
            self._lose(pull_id)
        for request_id, (_, block_ids) in list(self._aside.items()):
            del self._aside[request_id]
            self._fail(request_id, block_ids)
        self._unheld.update(self._holds)
        self._holds.clear()
        self._unanswered.clear()
        self._cursor = self._pull_cursor = 0
        self.generation = -1  # named by no registration: every call of ours is refused (409)

    def _tell(self, line: str, error: bool = False) -> None:
        """Log ``line`` at most once per _WAITING_LOG_S (the state it reports is asked every
        step)."""
        now = time.monotonic()
        if now - self._waiting_told >= _WAITING_LOG_S:
            self._waiting_told = now
            log.log(logging.ERROR if error else logging.INFO, line)

    def take_stale(self) -> bool:
        """Whether a hold placed since the last call named a stale epoch/generation."""
        stale, self._stale = self._stale, False
        return stale

    def _give_up(self, hold_id: str) -> None:
        """Abort a hold nobody can claim (its release is not waited for: freed at once).

        Safe: the only ticket naming it was minted for another epoch or generation, and every
        claim of such a ticket is refused, so no reader holds a claim and the abort releases it.
        """
        try:
            self.client.abort(hold_id)
        except KvxferdError as exc:
            log.warning("abort of stale hold %s failed (it will expire): %s", hold_id, exc)

    def take_failed(self) -> set[str]:
        """Requests whose pull or store load failed since the last call (vLLM fails or
        recomputes them whole: block ids alone name no request when there are several groups)."""
        out, self._failed = self._failed, set()
        return out | self.store.take_failed()

    def load_errors(self) -> set[int]:
        """Local block ids whose pull failed since the last call (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out | self.store.take_errors()

    def _close_ipc(self) -> None:
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None

    def close(self) -> None:
        """Unregister (the memory goes away with the engine) and close the client."""
        try:
            if self.generation >= 0:
                self.client.unregister(self.generation)
        except KvxferdError as exc:  # a pod's: another rank's unregister may have ended it
            gone = self.pod and isinstance(exc, (NotRegisteredError, StaleGenerationError))
            log.log(logging.INFO if gone else logging.WARNING, "unregister at shutdown: %s", exc)
        self._outbox.close()
        self._close_ipc()
        self.client.close()
        if self._lock is not None:  # (the kernel drops it with the process anyway)
            os.close(self._lock)
            self._lock = None
