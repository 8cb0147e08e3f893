"""The simulated engine: what prefill, decode and colocated ranks do with a prompt's KV blocks.

Prefill writes the verification pattern into freshly allocated blocks on every rank, holds them
through every rank's sidecar (after answering, with tickets it minted, once it may: see
kvxferd.sim.minting) and frees them when every sidecar reports the hold released (a hold that
got no answer, nor did its abort, waits for one: kvxferd.sim.unanswered).
Decode reuses full attention blocks from its prefix cache, pulls the rest on every rank,
verifies every byte and generates. Colocated (and any request without kv_transfer_params)
writes the pattern locally. The generated text is a pure function of the request's KV bytes.

All bookkeeping runs on the event loop; pattern writes, verification and digests (numpy, GIL
released) run in worker threads over blocks no other request touches, except for requests of at
most ``INLINE_BYTES`` (a thread hop costs more than the work; at 64 requests in flight the hops
were a visible share of the sim's time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvxferd.client import AsyncEngineClient
from kvxferd.errors import (
    DuplicateHoldError,
    HoldError,
    HoldExpiredError,
    InvalidRequestError,
    KvxferdError,
    PoolExhaustedError,
    PullError,
    UnknownHoldError,
)
from kvxferd.layout import request_blocks
from kvxferd.pattern import (
    Mismatch,
    token_digest,
    verify_token_pattern,
    write_token_pattern,
)
from kvxferd.sim import storecache
from kvxferd.sim.blocks import BlockAllocator, PrefixCache
from kvxferd.sim.decodeblocks import DecodeBlocks, return_blocks, take_blocks
from kvxferd.sim.kvpool import RankPool
from kvxferd.sim.minting import Minter
from kvxferd.sim.pulls import pull_all
from kvxferd.sim.stats import SimStats
from kvxferd.sim.tokens import generate, prompt_seed
from kvxferd.sim.unanswered import UnansweredHolds, abort_placement
from kvxferd.wire import (
    DECLINE_REASON_MAX_LENGTH,
    HoldRequest,
    PullRequest,
    ReleasedHold,
    Ticket,
    one_line,
)
from kvxferd.wire import transfer_params as tp

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "colocated"]
PullFailurePolicy = Literal["recompute", "fail"]
_MASK = (1 << 64) - 1
INLINE_BYTES = 256 * 1024
"""Requests whose blocks (all ranks) hold at most this many bytes are written, verified and
digested on the event loop instead of in a worker thread."""


@dataclass(frozen=True)
class EngineSettings:
    """How the engine behaves (the ``kvxferd sim`` flags)."""

    role: Role
    engine_id: str
    on_pull_failure: PullFailurePolicy = "recompute"
    lease_s: float | None = None
    """Hold lease sent with every hold (None: the sidecar's default)."""
    pull_timeout_s: float = 30.0
    """Deadline of one request's pull."""
    release_poll_s: float = 0.1
    """Interval of the released-holds poll while holds are outstanding."""
    decline_timeout_s: float = 10.0
    """Bound on one decline call to the sidecar (it runs in the background)."""
    unanswered_retry_s: float = 1.0
    """Interval of the aborts retried for holds whose placement and abort got no answer."""
    unanswered_bound_s: float = 600.0
    """How long such a hold's blocks wait for a sidecar answer before they are freed anyway."""
    store_chunk_tokens: int = 0
    """Prefill: use the sidecars' store as a prefix-cache tier with chunks of this many tokens
    (:mod:`kvxferd.sim.storecache`); 0: no store."""


@dataclass(frozen=True)
class Prompt:
    """A parsed completion or chat request, as far as the engine cares."""

    tokens: list[int]
    max_tokens: int
    request_id: str
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Generation:
    """The engine's answer: token strings and, from a prefill, the params for the decode."""

    tokens: list[str]
    prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Held:
    """A prefill request whose blocks some rank still holds."""

    blocks: list[int]
    pending: set[int]
    hold_ids: list[str] = field(default_factory=list)
    """Each rank's hold id (the tickets' ``hold_id``, rank order)."""
    reasons: set[str] = field(default_factory=set)
    placing: bool = False
    """Minted here, its holds still being placed (an abort now refuses the placement)."""


class SimEngine:
    """One simulated engine (all its TP ranks) behind the OpenAI-style app."""

    def __init__(
        self,
        settings: EngineSettings,
        pools: Sequence[RankPool],
        clients: Sequence[AsyncEngineClient] = (),
        peer: str = "",
        alive: Callable[[], str] = lambda: "",
        secret: bytes | None = None,
    ) -> None:
        self.settings = settings
        self.pools = list(pools)
        self.clients = list(clients)
        self.peer = peer
        self._alive = alive
        self.manifest = pools[0].manifest
        self._block_bytes = sum(r.page_bytes for p in self.pools for r in p.manifest.regions)
        self.blocks = BlockAllocator(self.manifest.num_blocks)
        self.prefix = PrefixCache()
        self.stats = SimStats(role=settings.role)
        self._held: dict[str, _Held] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._declines: set[asyncio.Task[None]] = set()
        self.minter = Minter(self.clients, secret, settings.lease_s)  # prefill: tickets minted here
        self._placing: set[asyncio.Task[None]] = set()  # holds of minted tickets being placed
        self.unanswered = UnansweredHolds(self.clients, self._settle,
                                          retry_s=settings.unanswered_retry_s,
                                          bound_s=settings.unanswered_bound_s)  # fmt: skip

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the released-holds pollers (prefill ranks only)."""
        if self.settings.role == "prefill":
            self._tasks = [
                asyncio.create_task(self._poll_released(r, c), name=f"released-{r}")
                for r, c in enumerate(self.clients)
            ]
            self._tasks.append(asyncio.create_task(self.unanswered.run(), name="unanswered"))

    async def close(self) -> None:
        """Finish pending declines (bounded), stop the pollers and close the sidecar clients."""
        if self._declines:
            await asyncio.wait(self._declines, timeout=self.settings.decline_timeout_s)
        for t in [*self._tasks, *self._placing]:
            t.cancel()
        for t in [*self._tasks, *self._placing]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for c in self.clients:
            await c.aclose()

    def problem(self) -> str:
        """Why the engine cannot serve ("" when healthy): e.g. a sidecar exited."""
        return self._alive()

    def snapshot(self) -> dict[str, object]:
        """The ``/v1/stats`` object."""
        s = self.stats
        s.blocks_free, s.blocks_total = self.blocks.free_count, self.blocks.total
        s.blocks_cached, s.holds_outstanding = len(self.prefix), len(self._held)
        s.holds_abandoned = self.unanswered.abandoned
        return s.as_dict()

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, prompt: Prompt) -> Generation:
        """Run one request the way this engine's role says."""
        params = prompt.kv_transfer_params
        role = self.settings.role
        if role == "prefill" and tp.wants_remote_decode(params):
            gen = await self._prefill(prompt)
        elif role == "decode" and tp.has_remote_prefill(params):
            assert params is not None
            gen = await self._decode(prompt, params)
        else:
            gen = await self._local(prompt)
        self.stats.prompt_tokens += gen.prompt_tokens
        self.stats.completion_tokens += len(gen.tokens)
        return gen

    async def _local(self, prompt: Prompt) -> Generation:
        need = self._need(prompt)
        ids = self._split(self._allocate(sum(need)), need)
        n = len(prompt.tokens)
        try:
            await self._on_ranks(write_token_pattern, ids, n, prompt_seed(prompt.tokens))
            digest = await self._digest(ids, n)
        finally:
            self.blocks.free(b for g in ids for b in g)
        self.stats.local += 1
        return Generation(generate(digest, prompt.max_tokens), len(prompt.tokens))

    async def _prefill(self, prompt: Prompt) -> Generation:
        need = self._need(prompt)
        flat = self._allocate(sum(need))
        ids = self._split(flat, need)
        n = len(prompt.tokens)
        try:
            if self.settings.store_chunk_tokens:
                await storecache.fill(self, prompt.tokens, ids, prompt_seed(prompt.tokens))
            else:
                await self._on_ranks(write_token_pattern, ids, n, prompt_seed(prompt.tokens))
            digest = await self._digest(ids, n)
            minted = self.minter.ready
            if minted:  # answered now, held just after (as the vLLM connector does)
                tickets = self.minter.mint(prompt.request_id, ids, n)
                self.stats.tickets_minted += 1
            else:
                tickets = await self._hold(prompt.request_id, ids, n)
        except BaseException:
            self.blocks.free(flat)
            raise
        hold_ids = [t.hold_id for t in tickets]
        self._held[prompt.request_id] = _Held(flat, set(range(len(self.clients))), hold_ids,
                                              placing=minted)  # fmt: skip
        self._wake.set()
        if minted:
            task = asyncio.create_task(self._place(prompt.request_id, ids, n, tickets),
                                       name="place-holds")  # fmt: skip
            self._placing.add(task)
            task.add_done_callback(self._placing.discard)
        else:
            await self.minter.learn(tickets)
        params = tp.prefill_answer(
            engine_id=self.settings.engine_id,
            request_id=prompt.request_id,
            peer=self.peer,
            tickets=tickets,
        )
        return Generation(generate(digest, prompt.max_tokens), len(prompt.tokens), params)

    async def _decode(self, prompt: Prompt, params: dict[str, Any]) -> Generation:
        tickets = tp.parse_tickets(params)
        seed = prompt_seed(prompt.tokens)
        n = len(prompt.tokens)
        try:
            need = self._need(prompt)
            self._check_tickets(tickets, need, n)
            lease = take_blocks(self.manifest, self.prefix, self._allocate, seed, need, n)
            self.stats.prefix_hits += len(lease.hits)
        except BaseException as exc:  # refused before reading: the prefill holds are useless
            self.decline(tickets, "aborted" if isinstance(exc, asyncio.CancelledError) else
                         f"rejected: {type(exc).__name__}")  # fmt: skip
            raise
        keep, settled = False, True
        try:
            # Our own block ids and the token count: the prefill's block sizes may differ.
            req = PullRequest(tickets=tickets, block_ids=lease.pull_ids, num_tokens=n,
                              deadline_s=self.settings.pull_timeout_s)  # fmt: skip
            outcome = await pull_all(self.clients, req)
            settled = outcome.settled
            if outcome.ok:
                self._count_pull(outcome.kv_bytes, outcome.state_bytes, outcome.seconds, lease)
                keep = await self._verify(lease.ids, n, seed, prompt.request_id)
            else:
                self.stats.pulls_failed += 1
                log.warning("pull for %s failed: %s", prompt.request_id, outcome.reason)
                self.decline(tickets, f"pull failed: {outcome.reason}")  # never read now
                if self.settings.on_pull_failure == "fail" or not settled:
                    raise PullError("pull_failed", f"KV pull from the prefill failed: "
                                    f"{outcome.reason}")  # fmt: skip
                await self._on_ranks(write_token_pattern, lease.pull_ids, n, seed)
                self.stats.recomputed += 1
                keep = True
            digest = await self._digest(lease.ids, n)
        finally:
            return_blocks(lease, self.prefix, self.blocks, keep, settled)
        return Generation(generate(digest, prompt.max_tokens), len(prompt.tokens))

    # -- holds a decode will not read ----------------------------------------------------------

    def decline(self, tickets: list[Ticket], reason: str) -> None:
        """Decode side: tell the prefill sides behind ``tickets`` this engine will not read them
        (through rank 0's sidecar, in the background, bounded), so their holds end now.
        ``reason`` goes on one line, cut to what a decline carries (a pull's failure text may
        be longer, or hold a peer's line breaks: the sidecar would refuse the decline)."""
        if self.settings.role != "decode" or not self.clients or not tickets:
            return
        reason = one_line(reason)[:DECLINE_REASON_MAX_LENGTH]
        task = asyncio.create_task(self._decline(tickets, reason), name="decline")
        self._declines.add(task)
        task.add_done_callback(self._declines.discard)

    def decline_params(self, params: Any, reason: str) -> None:
        """:meth:`decline` for a request refused before its ``kv_transfer_params`` were parsed:
        decline whatever well-formed tickets they carry (nothing when there are none)."""
        if self.settings.role != "decode" or not tp.has_remote_prefill(params):
            return
        try:
            tickets = tp.parse_tickets(params)
        except InvalidRequestError:
            return  # no usable tickets: nothing we could decline
        self.decline(tickets, reason)

    async def _decline(self, tickets: list[Ticket], reason: str) -> None:
        self.stats.declined += 1
        try:
            async with asyncio.timeout(self.settings.decline_timeout_s):
                await self.clients[0].decline(tickets, reason)
        except (KvxferdError, httpx.HTTPError, TimeoutError) as exc:
            self.stats.declines_failed += 1
            log.warning("declining %d tickets (%s) failed: %s", len(tickets), reason, exc)

    async def give_up(self, params: Any) -> int:
        """Prefill side: abort the holds of a request whose decode will not read them (the proxy
        says so with the ``kv_transfer_params`` we answered). Only a caller that has the
        request's tickets can: every rank's hold id must match. The number of ranks aborted
        (0 when the request is unknown or already released); its blocks come back through the
        released feed as usual."""
        if not isinstance(params, dict):
            raise InvalidRequestError(tp.FIELD, "must be the object the prefill answered")
        held = self._held.get(str(params.get("remote_request_id")))
        given = params.get("kvxferd_tickets")
        if held is None or self.settings.role != "prefill":
            return 0
        if (
            not isinstance(given, list)
            or [t.get("hold_id") if isinstance(t, dict) else None for t in given] != held.hold_ids
        ):
            return 0
        aborted = 0
        for rank in sorted(held.pending):
            try:
                await self.clients[rank].abort(held.hold_ids[rank])
                aborted += 1
            except (UnknownHoldError, HoldExpiredError):
                if held.placing:  # given up before its placement, which is refused now
                    aborted += 1
                continue  # released meanwhile (read, expired, declined): the feed says so
            except (KvxferdError, httpx.HTTPError) as exc:
                log.warning("rank %d: giving up hold %s failed: %s", rank, held.hold_ids[rank],
                            exc)  # fmt: skip
        if aborted:
            self.stats.holds_given_up += 1
        return aborted

    # -- blocks -------------------------------------------------------------------------------

    def _need(self, prompt: Prompt) -> list[int]:
        need = request_blocks(self.manifest, len(prompt.tokens))
        if sum(need) > self.blocks.total:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt.tokens)} tokens need {sum(need)} KV blocks, the whole pool has "
                f"{self.blocks.total} (raise --pool-blocks)",
            )
        return need

    def _allocate(self, n: int) -> list[int]:
        short = n - self.blocks.free_count
        if short > 0:
            self.blocks.free(self.prefix.evict(short))
        try:
            return self.blocks.allocate(n)
        except PoolExhaustedError as exc:
            raise PoolExhaustedError(
                f"{exc}; {len(self._held)} requests held for remote decode, "
                f"{len(self.prefix)} blocks cached in use; retry later"
            ) from None

    @staticmethod
    def _split(flat: list[int], need: list[int]) -> list[list[int]]:
        out, start = [], 0
        for n in need:
            out.append(flat[start : start + n])
            start += n
        return out

    def _check_tickets(self, tickets: list[Ticket], need: list[int], num_tokens: int) -> None:
        remote = [len(g) for g in tickets[0].block_ids]
        # Other counts for the same tokens are a prefill with other block sizes (re-blocking:
        # our sidecar checks its ids against the prefill's manifest).
        if remote != need and tickets[0].num_tokens != num_tokens:
            raise InvalidRequestError(
                f"{tp.FIELD}.remote_block_ids",
                f"blocks per group {remote} from the prefill, this engine needs {need} for "
                f"{num_tokens} prompt tokens (same prompt, model and block size on both sides?)",
            )
        if tickets[0].num_tokens != num_tokens:
            raise InvalidRequestError(
                f"{tp.FIELD}.kvxferd_tickets[0].num_tokens",
                f"{tickets[0].num_tokens} prefilled tokens, the prompt has {num_tokens}",
            )

    # -- ranks --------------------------------------------------------------------------------

    async def _on_ranks(self, fn: Callable[..., Any], ids: list[list[int]], *args: int) -> list:
        if sum(len(g) for g in ids) * self._block_bytes <= INLINE_BYTES:
            return [fn(p.manifest, p.views, ids, *args) for p in self.pools]
        return await asyncio.gather(
            *(asyncio.to_thread(fn, p.manifest, p.views, ids, *args) for p in self.pools)
        )

    async def _digest(self, ids: list[list[int]], num_tokens: int) -> int:
        """Sum of the ranks' token digests: the request's KV bytes, whatever the block ids."""
        return sum(await self._on_ranks(token_digest, ids, num_tokens)) & _MASK

    async def _verify(self, ids: list[list[int]], n: int, seed: int, request_id: str) -> bool:
        found: list[Mismatch | None] = await self._on_ranks(verify_token_pattern, ids, n, seed)
        bad = [(r, m) for r, m in enumerate(found) if m is not None]
        if bad:
            self.stats.verified_failed += 1
            log.error("request %s: KV bytes differ on rank %d: %s", request_id, *bad[0])
            return False
        self.stats.verified_ok += 1
        return True

    def _count_pull(self, kv: int, state: int, seconds: float, lease: DecodeBlocks) -> None:
        s = self.stats
        s.pulls_ok += 1
        s.kv_bytes += kv
        s.state_bytes += state
        s.transfer_seconds += seconds
        s.blocks_pulled += sum(1 for g in lease.pull_ids for b in g if b >= 0)

    async def _hold(self, request_id: str, ids: list[list[int]], num_tokens: int) -> list[Ticket]:
        req = HoldRequest(request_id=request_id, block_ids=ids, num_tokens=num_tokens,
                          lease_s=self.settings.lease_s)  # fmt: skip
        results = await asyncio.gather(*(c.hold(req) for c in self.clients), return_exceptions=True)
        failed = [(r, e) for r, e in enumerate(results) if isinstance(e, BaseException)]
        if not failed:
            return [t for t in results if isinstance(t, Ticket)]
        for c, t in zip(self.clients, results, strict=True):
            if isinstance(t, Ticket):
                with contextlib.suppress(KvxferdError, httpx.HTTPError):
                    await c.abort(t.hold_id)
        rank, exc = failed[0]
        if not isinstance(exc, KvxferdError | httpx.HTTPError):
            raise exc
        raise HoldError(f"sidecar of rank {rank} did not hold the blocks: {exc}") from exc

    async def _place(
        self, request_id: str, ids: list[list[int]], num_tokens: int, tickets: list[Ticket]
    ) -> None:
        """Place the holds of tickets minted here. If a rank does not, the request's hold is
        given up on every rank (a claim waiting for it ends at once, so its decode recomputes
        or fails) and its blocks come back once each rank that placed it released it."""
        reqs = [HoldRequest(request_id=request_id, block_ids=ids, num_tokens=num_tokens,
                            lease_s=self.settings.lease_s, hold_id=t.hold_id,
                            generation=t.generation) for t in tickets]  # fmt: skip
        calls = (c.hold(r) for c, r in zip(self.clients, reqs, strict=True))
        results = await asyncio.gather(*calls, return_exceptions=True)
        hold_ids = [t.hold_id for t in tickets]
        held = self._held.get(request_id)
        if held is not None and held.hold_ids == hold_ids:
            held.placing = False
        failed = [(r, e) for r, e in enumerate(results) if isinstance(e, BaseException)]
        if not failed:
            return
        if all(isinstance(e, DuplicateHoldError) for _, e in failed):
            # Given up before it was placed (give_up: the proxy's release came first).
            log.debug("request %s: given up before its hold was placed", request_id)
        else:
            self.minter.forget()
            self.stats.holds_failed += 1
            log.warning("request %s: the sidecar of rank %d did not place its hold (%s); giving "
                        "it up on every rank", request_id, *failed[0])  # fmt: skip
        keep, unanswered = await abort_placement(self.clients, results, hold_ids)
        held = self._held.get(request_id)  # again: the aborts awaited
        if held is None or held.hold_ids != hold_ids:
            return  # released already (every rank that placed it)
        held.pending &= keep
        for rank in unanswered:
            if rank in held.pending:
                self.stats.holds_unanswered += 1
                self.unanswered.add(request_id, rank, hold_ids[rank])
        if not held.pending:
            self._free_held(request_id, held)

    def _settle(self, request_id: str, rank: int) -> None:
        """``rank`` does not hold the request (any more): free its blocks once no rank does."""
        held = self._held.get(request_id)
        if held is not None and rank in held.pending:
            held.pending.discard(rank)
            if not held.pending:
                self._free_held(request_id, held)

    async def _poll_released(self, rank: int, client: AsyncEngineClient) -> None:
        """Follow one rank's released-holds feed; free a request's blocks once all ranks did."""
        cursor = 0
        while True:
            if not self._held:
                self._wake.clear()
                await self._wake.wait()
            try:
                feed = await client.released(cursor)
            except (KvxferdError, httpx.HTTPError) as exc:
                log.warning("rank %d: released-holds feed unavailable: %s", rank, exc)
                await asyncio.sleep(1.0)
                continue
            cursor = feed.cursor
            for hold in feed.holds:
                self._on_released(rank, hold)
            await asyncio.sleep(self.settings.release_poll_s)

    def _on_released(self, rank: int, hold: ReleasedHold) -> None:
        held = self._held.get(hold.request_id)
        if held is None or rank not in held.pending:
            return
        held.pending.discard(rank)
        held.reasons.add(hold.reason)
        if not held.pending:
            self._free_held(hold.request_id, held)

    def _free_held(self, request_id: str, held: _Held) -> None:
        """Every rank that held the request released it: its blocks are ours again."""
        del self._held[request_id]
        self.blocks.free(held.blocks)
        if held.reasons:
            self.stats.holds_released += 1
        if "expired" in held.reasons:
            self.stats.holds_expired += 1
        log.debug("request %s released (%s)", request_id, ",".join(sorted(held.reasons)))
