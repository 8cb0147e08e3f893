"""The scheduler side of the connector: tickets minted here, holds and pulls handed to workers.

``request_finished_all_groups`` must answer at once, so the scheduler process mints each prefill
rank's ticket itself (the shared secret read locally, each rank's Identity read once; a pod
sidecar's one Identity and one ticket for every rank) and the workers place the holds with the
minted ids in the same step. On the decode side a request with
tickets loads asynchronously (WAITING_FOR_REMOTE_KVS) and pulls only the blocks it lacks.

A decode's ``kv_transfer_params`` come from whoever sent the request, and an exception raised in
vLLM's scheduler stops the engine for every request: they are checked first (:class:`Remote`),
and params that do not check out are dropped, so that request is computed locally.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvxferd.errors import InvalidRequestError, KvxferdError
from kvxferd.sidecar.deadlines import DeadlineBuckets
from kvxferd.sidecar.tickets import mint_tickets
from kvxferd.vllm import binding
from kvxferd.vllm.storeplan import LoadOrder, SaveOrder, StorePlanner
from kvxferd.wire import MAX_TICKETS_PER_CALL, Identity
from kvxferd.wire import transfer_params as tp

log = logging.getLogger(__name__)

NULL_BLOCK = 0
"""vLLM's reserved null block: never held, never pulled."""

IDENTITY_RETRY_S = 1.0
"""After the prefill's sidecars could not say who they are, how long finished requests go
without a hold before they are asked again (a hung sidecar must not stall every step)..."""
IDENTITY_RETRY_RATIO = 10.0
"""...and at least this many times as long as the failed asking took (a sidecar that hangs
until the client's timeout stalls the scheduler for at most a tenth of its time)."""
MAX_BLOCK_SIZE = 1 << 20
"""Largest ``remote_block_size`` taken (tokens; vLLM's hybrid block sizes are far below)."""
TRUNCATED = "_kvxferd_truncated"
"""Marks (in its own kv_transfer_params) a prefill whose last prompt token was dropped."""
KEEPALIVE_S = 10.0
"""How often the holds of a decode request vLLM still queues are kept alive (sooner the first
time when its tickets' lease ends sooner)..."""
KEEPALIVE_EXTEND_S = 30.0
"""...how far each keepalive pushes their leases (each prefill caps it at its max lease)..."""
KEEPALIVE_FOR_S = 600.0
"""...and for how long at most: a request queued longer lets the prefill's blocks go (its pull
then fails and vLLM computes it), as the prefill's memory is not the decode's to keep."""


@dataclass(frozen=True)
class Remote:
    """A decode request's checked remote prefill: its tickets (as the workers send them), the
    prefill's block ids per group, the tokens it computed and its block size."""

    tickets: list[dict[str, Any]]
    block_ids: list[list[int]]
    num_tokens: int
    block_size: int


def read_remote(
    params: dict[str, Any], prompt_len: int, block_size: int, groups: int | None
) -> Remote:
    """The remote prefill a decode's params name; InvalidRequestError naming the first field
    that does not check out (tickets, their group count unless ``groups`` is None, token count
    beyond the prompt or not the tickets', block size).

    The token count is the tickets' (signed, checked by the decode's sidecar before any READ):
    ``remote_num_tokens`` is the client's copy, and a larger one would have vLLM take tokens
    no READ writes as loaded (and prefix-cache whatever their blocks held)."""
    tickets = tp.parse_tickets(params)
    theirs = len(tickets[0].block_ids)
    if groups is not None and theirs != groups:
        raise InvalidRequestError(
            f"{tp.FIELD}.kvxferd_tickets[0].block_ids", f"{theirs} groups, this engine has {groups}"
        )
    num_tokens = tickets[0].num_tokens
    for i, t in enumerate(tickets):
        if t.num_tokens != num_tokens or t.num_tokens > prompt_len:
            raise InvalidRequestError(
                f"{tp.FIELD}.kvxferd_tickets[{i}].num_tokens",
                f"{t.num_tokens}: not ticket 0's {num_tokens}, or beyond the prompt's "
                f"{prompt_len} tokens",
            )  # fmt: skip
    tp.int_field(params, "remote_num_tokens", num_tokens, low=num_tokens, high=num_tokens)
    return Remote(
        tickets=msgspec.to_builtins(tickets),
        block_ids=tickets[0].block_ids,
        num_tokens=num_tokens,
        block_size=tp.int_field(
            params, "remote_block_size", block_size, low=1, high=MAX_BLOCK_SIZE
        ),  # fmt: skip
    )


@dataclass
class HoldOrder:
    """A hold every prefill worker places with the id its ticket names."""

    request_id: str
    hold_id: str
    block_ids: list[list[int]]
    num_tokens: int
    minted: list[tuple[int, int]] = field(default_factory=list)
    """Per rank (a pod: one for all), the (epoch, generation) its ticket names: a worker whose
    sidecar differs (restarted, re-registered) reports the rank stale and frees the blocks."""


@dataclass
class Decline:
    """Tickets a decode will not read (the workers send one decline for them)."""

    tickets: list[dict[str, Any]]
    reason: str


@dataclass
class PullOrder:
    """A pull the decode workers start: remote tickets, local blocks (-1: already local)."""

    request_id: str
    tickets: list[dict[str, Any]]
    block_ids: list[list[int]]
    num_tokens: int


@dataclass
class StepOrders:
    """What the workers do this step (vLLM's connector metadata carries it)."""

    holds: list[HoldOrder] = field(default_factory=list)
    pulls: list[PullOrder] = field(default_factory=list)
    declines: list[Decline] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    """Store saves, run first (the blocks may be reused later in the step)."""
    loads: list[LoadOrder] = field(default_factory=list)
    failed: list[PullOrder] = field(default_factory=list)
    """Loads promised to vLLM that cannot be made (params found bad after allocation): the
    workers report them ended with every block a load error, so vLLM recomputes them."""
    keepalives: list[dict[str, Any]] = field(default_factory=list)
    """Tickets of decode requests vLLM still queues: a worker extends their holds' leases."""


def live_ids(ids: list[int]) -> list[int]:
    """A group's block ids without vLLM's null block (Mamba groups are mostly null)."""
    return [b for b in ids if b != NULL_BLOCK]


def local_targets(remote: list[list[int]], local: list[list[int]], skip: int) -> list[list[int]]:
    """Per group, the local blocks aligned with the remote ones (both from the end, so a Mamba
    group's running state meets its state block); -1 for the first ``skip`` attention blocks
    the decode already holds (prefix-cache hit). Equal block sizes: ids pair one to one."""
    out = []
    for r, loc in zip(remote, local, strict=True):
        mine = live_ids(loc)[-len(r) :] if r else []
        if len(mine) < len(r):
            mine = [-1] * (len(r) - len(mine)) + mine
        if len(r) > 1 and skip:
            mine = [-1] * min(skip, len(r)) + mine[skip:]
        out.append(mine)
    return out


def reblock_targets(
    kinds: list[str], local: list[list[int]], num_tokens: int, block_size: int, done: int
) -> list[list[int]]:
    """Per group, the decode's own ids when its block size differs from the prefill's (the
    sidecar maps tokens, docs/reblocking.md): attention, the request's blocks from the first in
    position (null or already computed: -1) up to the one holding token ``num_tokens - 1``;
    Mamba, the running-state block."""
    need = -(-num_tokens // block_size)
    skip = done // block_size
    out = []
    for kind, loc in zip(kinds, local, strict=True):
        if kind == "mamba":
            out.append(live_ids(loc)[-1:])
            continue
        ids = list(loc[:need])
        out.append([-1 if k < skip or b == NULL_BLOCK else b for k, b in enumerate(ids)])
    return out


class SchedulerSide:
    """Per-engine scheduler state of the connector (one instance in the scheduler process)."""

    def __init__(
        self,
        *,
        engine_id: str,
        tp_size: int,
        secret: bytes,
        identities: Callable[[], list[Identity]],
        block_size: int,
        partial_prefill: bool,
        group_kinds: list[str] | None = None,
        store: StorePlanner | None = None,
        pod: bool = False,
    ) -> None:
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.pod = pod  # the workers share one pod sidecar: one identity, one ticket
        self._secret = secret
        self._identities = identities
        self._known: list[Identity] | None = None
        self._ask_after = 0.0  # monotonic time before which identities are not asked again
        self.block_size = block_size
        self.group_kinds = group_kinds  # "mamba" or "attention" per KV-cache group
        self.partial_prefill = partial_prefill  # Mamba: the decode recomputes the last token
        self.orders = StepOrders()
        self.store = store  # the store as a prefix-cache tier (None: off)
        # Decode requests with tickets that vLLM has not allocated yet (as many as vLLM holds):
        # (when their next keepalive is due, when keepalives stop, their tickets), and that
        # schedule.
        self._queued: dict[str, tuple[float, float, list[dict[str, Any]]]] = {}
        self._keepalive_due = DeadlineBuckets(resolution_s=0.25)

    def identities(self) -> list[Identity]:
        """Each prefill rank's sidecar identity (read once; again after a rank went stale)."""
        if self._known is None:
            self._known = self._identities()
        return self._known

    def _minting(self) -> list[Identity] | None:
        """The identities to mint tickets with, or None while a sidecar cannot say or has no
        engine registered: the request then ends like a local one (an exception here would
        stop vLLM's scheduler, and every request with it)."""
        if self._known is None and time.monotonic() < self._ask_after:
            return None
        asked = time.monotonic()
        try:
            idents = self.identities()
        except KvxferdError as exc:
            log.warning("prefill sidecars unavailable, finishing without holds: %s", exc)
        else:
            shape = [self.tp_size] if self.pod else [1] * self.tp_size  # pod_ranks per sidecar
            if [i.pod_ranks for i in idents] != shape:  # the workers refuse it at start
                log.warning("prefill sidecars serve %s ranks, expected %s: finishing without "
                            "holds", [i.pod_ranks for i in idents], shape)  # fmt: skip
            elif all(i.generation >= 0 for i in idents):
                return idents
            else:
                log.warning("a prefill sidecar has no engine registered: finishing without holds")
            self._known = None
        now = time.monotonic()
        self._ask_after = now + max(IDENTITY_RETRY_S, IDENTITY_RETRY_RATIO * (now - asked))
        return None

    def stale(self, ranks: set[int]) -> None:
        """Workers found these ranks' sidecars restarted or re-registered: re-read the
        identities before the next ticket is minted (off the per-request path until then)."""
        if ranks:
            self._known = None

    def new_request(self, request: Any) -> None:
        """A prefill for a remote decode of a Mamba hybrid (``partial_prefill``) computes all
        but the prompt's last token: the decode recomputes that one, on the state after the
        tokens before it (a state past it cannot be rewound, and attention blocks counted for
        the whole prompt no longer pair with the decode's). Once per request, as vLLM's NIXL."""
        params = request.kv_transfer_params
        if (
            not self.partial_prefill
            or not tp.wants_remote_decode(params)
            or params.get(TRUNCATED)
            or request.prompt_token_ids is None
            or request.num_prompt_tokens < 2
            or request.get_skip_reading_prefix_cache()  # the decode loads nothing then
        ):
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params[TRUNCATED] = True

    # ---------------------------------------------------------------- decode side

    def queued(self, request: Any) -> None:
        """A decode request with tickets arrived: its holds are kept alive while vLLM queues it
        (a queue can outlast a lease). Params that do not parse are left to ``matched_tokens``."""
        params = request.kv_transfer_params
        if not tp.has_remote_prefill(params):
            return
        try:
            tickets = tp.parse_tickets(params)
        except InvalidRequestError:
            return
        left = min(t.expires_at for t in tickets) - time.time()
        now = time.monotonic()
        due, until = now + min(KEEPALIVE_S, max(0.0, left / 2)), now + KEEPALIVE_FOR_S
        self._queued[request.request_id] = (due, until, msgspec.to_builtins(tickets))
        self._keepalive_due.set(request.request_id, due)

    def _dequeued(self, request: Any) -> None:
        """vLLM allocated ``request`` (its pull claims the holds) or ended it: no keepalives."""
        if self._queued.pop(request.request_id, None) is not None:
            self._keepalive_due.drop(request.request_id)

    def _keep_alive(self) -> None:
        """Put the tickets of queued requests whose keepalive is due into this step's orders
        (at most MAX_TICKETS_PER_CALL requests; the rest are due next step)."""
        now = time.monotonic()
        due = self._keepalive_due.due(now, MAX_TICKETS_PER_CALL, lambda r: self._queued[r][0])
        for request_id in due:
            _, until, tickets = self._queued[request_id]
            if now >= until:
                del self._queued[request_id]  # (``due`` took it off the schedule)
                continue
            self.orders.keepalives.extend(tickets)
            self._queued[request_id] = (now + KEEPALIVE_S, until, tickets)
            self._keepalive_due.set(request_id, now + KEEPALIVE_S)

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """Tokens the prefill holds beyond what is local: load them asynchronously. With the
        store on, a prompt nothing is cached of locally is looked up (storeplan.py has the
        rules; ``store_order`` decides between a remote prefill and the store)."""
        remote = self._remote(request)
        hit = self._store_hit(request, remote is not None, num_computed)
        if hit:
            return hit, True
        if remote is None:
            return 0, False
        count = max(0, remote.num_tokens - num_computed)
        return count, count > 0

    def _remote(self, request: Any, groups: int | None = None) -> Remote | None:
        """The request's remote prefill, checked (None: it has none) against ``groups`` (else
        the engine's group kinds, when known). Params that do not check out are dropped with a
        warning, their tickets declined if they parse: the request is computed locally and the
        engine keeps serving."""
        params = request.kv_transfer_params
        if not tp.has_remote_prefill(params):
            return None
        if groups is None and self.group_kinds is not None:
            groups = len(self.group_kinds)
        if self.pod:  # its sidecar only holds: a pull through it would be refused
            why = "this engine's workers share a prefill pod sidecar, which does not pull"
            self._drop(request, InvalidRequestError(f"{tp.FIELD}.do_remote_prefill", why),
                       "computed_locally")  # fmt: skip
            return None
        try:
            n = len(request.prompt_token_ids or ())  # None: a prompt of embeddings
            remote = read_remote(params, n, self.block_size, groups)
            hold_id = remote.tickets[0]["hold_id"]
            binding.check(self._secret, params, hold_id, request, remote.num_tokens)
            return remote
        except InvalidRequestError as exc:
            self._drop(request, exc)
            return None

    def _drop(self, request: Any, exc: InvalidRequestError, reason: str = "malformed") -> None:
        """Compute ``request`` locally: its params do not check out (declining its tickets,
        when they parse, frees the prefill's blocks at once)."""
        self._dequeued(request)
        params = request.kv_transfer_params
        log.warning("request %.200r: kv_transfer_params ignored, computing it locally: %s",
                    request.request_id, exc)  # fmt: skip
        params["do_remote_prefill"] = False
        try:
            tickets = tp.parse_tickets(params)
        except InvalidRequestError:
            return
        self.orders.declines.append(Decline(msgspec.to_builtins(tickets), reason))

    def _store_hit(self, request: Any, remote: bool, num_computed: int) -> int:
        """Tokens to load from the store: only with nothing cached locally; with remote params
        only when ``store_first`` and the store holds the whole prompt (minus one token)."""
        store = self.store
        if store is None or not store.options.load:
            return 0
        if num_computed:  # a hit kept from a try vLLM could not allocate must not load now
            store.forget(request.request_id)
            return 0
        if remote and store.options.order != "store_first":
            return 0
        hit = store.match(request)
        if hit and remote and hit < len(request.prompt_token_ids) - 1:
            store.forget(request.request_id)
            return 0
        return hit

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """Blocks are allocated: queue the pull of the blocks the decode lacks (or the store
        load of a matched prompt, declining the remote tickets it makes unnecessary)."""
        self._dequeued(request)
        local = [list(g) for g in blocks.get_block_ids()]
        promised = num_external > 0 and tp.has_remote_prefill(request.kv_transfer_params)
        remote = self._remote(request, len(local))
        load = (
            self.store.load(request, blocks.get_block_ids(), num_external) if self.store else None
        )
        if load is not None:
            self.orders.loads.append(load)
            if remote is not None:
                self.orders.declines.append(Decline(remote.tickets, "store_hit"))
                request.kv_transfer_params["do_remote_prefill"] = False
            return
        if remote is None:
            if promised:  # dropped only now (no group kinds to check earlier): tokens promised
                live = [live_ids(g) for g in local]
                self.orders.failed.append(PullOrder(request.request_id, [], live, num_external))
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # load once
        if num_external <= 0:  # vLLM computes it here: the prefill's holds go now, not at expiry
            self.orders.declines.append(Decline(remote.tickets, "computed_locally"))
            return
        local_done = max(0, remote.num_tokens - num_external)
        if remote.block_size != self.block_size:  # re-blocking: the sidecar maps token ranges
            kinds = self.group_kinds or [
                "attention" if len(r) > 1 else "mamba" for r in remote.block_ids
            ]
            targets = reblock_targets(kinds, local, remote.num_tokens, self.block_size, local_done)
        else:
            targets = local_targets(remote.block_ids, local, local_done // self.block_size)
        self.orders.pulls.append(
            PullOrder(
                request_id=request.request_id,
                tickets=remote.tickets,
                block_ids=targets,
                num_tokens=remote.num_tokens,
            )
        )

    def decline(self, request: Any) -> None:
        """A decode that will not read (aborted, rejected) releases the prefill's holds at once:
        a worker sends the decline in the next step."""
        remote = self._remote(request)
        if remote is not None:
            status = getattr(request.status, "name", str(request.status))
            reason = "aborted" if status == "FINISHED_ABORTED" else "rejected"
            self.orders.declines.append(Decline(remote.tickets, reason))

    # ---------------------------------------------------------------- prefill side

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """A prefill finished: mint one ticket per rank (a pod: one), order the holds, delay the
        free. With
        store saves on, any request that ended normally is saved first (next step's orders)."""
        self._dequeued(request)
        if self.store is not None:
            self.store.forget(request.request_id)
            save = self.store.save(request, block_ids)
            if save is not None:
                self.orders.saves.append(save)
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and params.get("kvxferd_tickets"):
            self.decline(request)  # a decode request that ends before it loaded: free the prefill
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if status != "FINISHED_LENGTH_CAPPED":
            return False, None
        ids = [live_ids(list(g)) for g in block_ids]
        if not any(ids) or request.prompt_token_ids is None:  # embeddings: nothing to bind
            return False, None
        idents = self._minting()
        if idents is None:  # no decode can pull it: its blocks are freed as a local request's
            return False, None
        num_tokens = len(request.prompt_token_ids)
        if self.partial_prefill and not params.get(TRUNCATED):
            return False, None  # its state is past the decode's last token: computed there
        hold_id = secrets.token_hex(16)
        signed = mint_tickets(idents, self._secret, hold_id=hold_id, request_id=request.request_id,
                              block_ids=ids, num_tokens=num_tokens)  # fmt: skip
        tickets = [msgspec.to_builtins(t) for t in signed]
        minted = [(i.epoch, i.generation) for i in idents]
        self.orders.holds.append(HoldOrder(request.request_id, hold_id, ids, num_tokens, minted))
        first = idents[0]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": ids,
            "remote_host": first.peer_address.rsplit(":", 1)[0],
            "remote_port": int(first.peer_address.rsplit(":", 1)[-1] or 0),
            "remote_request_id": request.request_id,
            "tp_size": self.tp_size,
            "remote_num_tokens": num_tokens,
            "remote_block_size": self.block_size,
            "remote_blocks_expiry_time": signed[0].expires_at,
            "remote_registration_generation": first.generation,
            "kvxferd_tickets": tickets,
            binding.FIELD: binding.prompt_mac(self._secret, hold_id, request, num_tokens),
        }

    def take_orders(self) -> StepOrders:
        """This step's orders for the workers (and a fresh list for the next step)."""
        if self._queued:
            self._keep_alive()
        orders, self.orders = self.orders, StepOrders()
        return orders
