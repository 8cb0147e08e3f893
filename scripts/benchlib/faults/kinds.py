"""Fault kinds against the sidecar pair that act on a pull: kill -9, SIGSTOP/SIGCONT, tiny
deadlines, leases expiring mid-claim, forged/tampered/replayed/re-bound tickets.

Each takes the context and the kind name it is counted under, runs one fault and judges the
pulls it started; the at-rest checks run after it (scripts/fault_campaign.py).
"""

from __future__ import annotations

import math
import threading
import time

import msgspec

from kvxferd.sidecar.tickets import sign_ticket

from . import osproc
from . import pulls as P
from .context import Ctx

MAX_BLOCKS = 1500


def _normal_pull(ctx: Ctx, kind: str, n: int, deadline_s: float, lease_s: float | None = None):  # noqa: ANN202
    rec = ctx.pair.hold(kind, n, lease_s)
    dest = ctx.pair.dest(len(rec.blocks))
    run = P.start(ctx.pair, [rec.ticket], dest, rec.seed, deadline_s, holds=[rec])
    if isinstance(run, str):
        ctx.tally.note(kind, f"refused:{run.split(':')[0]}")
        return rec, None
    return rec, run


PHASES = ("pending", "claiming", "transferring", "transferring")
"""Where kills and stops aim (a handshake is only due after a restart, so it is hit then)."""


def _reach_phase(ctx: Ctx, run: P.PullRun, n: int) -> str:
    """Wait until the pull reaches a random phase, then a random part of its expected length;
    the state it was in when the fault struck."""
    state = P.watch(ctx.pair, run, ctx.rng.choice(PHASES))
    time.sleep(ctx.rng.uniform(0.0, 0.5 * ctx.pull_s * n / 750))
    return state


def kill9(ctx: Ctx, kind: str) -> None:
    """kill -9 the prefill or decode sidecar at a random point of a pull; restart it on the
    same port; the pull must end by its deadline, and a FAILED one must not write later."""
    side = ctx.rng.choice(["prefill", "decode"])
    node = ctx.pair.p if side == "prefill" else ctx.pair.d
    n = ctx.rng.randint(16, MAX_BLOCKS)
    rec, run = _normal_pull(ctx, kind, n, deadline_s=ctx.rng.uniform(1.0, 4.0))
    if run is None:
        return
    phase = _reach_phase(ctx, run, n)
    node.kill()
    ctx.tally.note(kind, f"{side}@{phase}")
    if side == "prefill":
        P.judge(ctx.pair, ctx.tally, kind, run)
    else:
        ctx.pair.d_blocks.give(run.dest)  # the decode is gone: nothing writes its pool now
    node.restart()


def sigstop(ctx: Ctx, kind: str) -> None:
    """SIGSTOP the prefill or decode sidecar at a random point of a pull, SIGCONT it after a
    random pause; the pull must end by its deadline (counted from the SIGCONT at the latest)."""
    side = ctx.rng.choice(["prefill", "decode"])
    node = ctx.pair.p if side == "prefill" else ctx.pair.d
    n = ctx.rng.randint(16, MAX_BLOCKS)
    _rec, run = _normal_pull(ctx, kind, n, deadline_s=ctx.rng.uniform(0.5, 3.0))
    if run is None:
        return
    phase = _reach_phase(ctx, run, n)
    pids = osproc.tree(node.pid)
    osproc.stop(pids)
    try:
        time.sleep(ctx.rng.uniform(0.1, 2.5))  # the pause is the fault
    finally:
        osproc.cont(pids)
    run.resumed_at = time.monotonic()
    ctx.tally.note(kind, f"{side}@{phase}")
    P.judge(ctx.pair, ctx.tally, kind, run)


def deadline(ctx: Ctx, kind: str) -> None:
    """A large scattered pull with a tiny deadline (3 ms .. 300 ms, log-uniform): it may end
    either way, but FAILED must mean nothing lands afterwards."""
    n = ctx.rng.randint(200, MAX_BLOCKS)
    dl = math.exp(ctx.rng.uniform(math.log(0.003), math.log(0.3)))
    _rec, run = _normal_pull(ctx, kind, n, deadline_s=dl)
    if run is None:
        return
    outcome = P.judge(ctx.pair, ctx.tally, kind, run)
    ctx.tally.note(kind, outcome)


def lease(ctx: Ctx, kind: str) -> None:
    """A hold with a tiny lease (50 ms .. 800 ms) pulled after a random delay, while its blocks
    are reused the moment the feed reports them released: a DONE pull must have read the
    hold's bytes, not the reuse."""
    n = ctx.rng.randint(16, MAX_BLOCKS)
    lease_s = ctx.rng.uniform(0.05, 0.8)
    rec = ctx.pair.hold(kind, n, lease_s)
    stop = threading.Event()
    follower = threading.Thread(target=_follow_feed, args=(ctx, stop), daemon=True)
    follower.start()
    try:
        time.sleep(ctx.rng.uniform(0.0, 1.2 * lease_s))  # when the decode gets round to it
        dest = ctx.pair.dest(len(rec.blocks))
        run = P.start(ctx.pair, [rec.ticket], dest, rec.seed, 5.0, holds=[rec])
        if isinstance(run, str):
            ctx.tally.note(kind, f"refused:{run.split(':')[0]}")
            return
        ctx.tally.note(kind, P.judge(ctx.pair, ctx.tally, kind, run))
    finally:
        stop.set()
        follower.join(timeout=10)


def _follow_feed(ctx: Ctx, stop: threading.Event) -> None:
    while not stop.is_set():
        ctx.pair.poll_feed()
        stop.wait(0.002)


TICKET_VARIANTS = ("forged", "tampered", "replayed", "rebound")


def ticket(ctx: Ctx, kind: str) -> None:
    """A pull with a ticket that must be refused: forged (naming the campaign's listener),
    tampered (block ids edited, old MAC), replayed (already pulled), re-bound (re-signed with
    the secret for other blocks than the hold's). It must never end DONE; the listener must
    never see the secret."""
    variant = ctx.rng.choice(TICKET_VARIANTS)
    ctx.tally.note(kind, variant)
    pair = ctx.pair
    n = ctx.rng.randint(1, 256)
    if variant == "replayed":
        if not ctx.done_tickets:
            rec, run = _normal_pull(ctx, kind, n, 5.0)
            if run is not None and P.judge(pair, ctx.tally, kind, run) == "done":
                ctx.done_tickets.append(rec.ticket)
            if not ctx.done_tickets:
                return
        t = ctx.done_tickets.pop()
        n = len(t.block_ids[0])
        bad, seed, holds = t, 0, []
    else:
        rec = pair.hold(kind, n)
        seed, holds, n = rec.seed, [rec], len(rec.blocks)
        t = rec.ticket
        if variant == "forged":
            bad = msgspec.structs.replace(t, peer=ctx.listener.address, hold_id="f" * 32,
                                          token="0" * 64)  # fmt: skip
        elif variant == "tampered":
            other = pair.p_blocks.take(ctx.rng, n)
            pair.p_blocks.give(other)
            bad = msgspec.structs.replace(t, block_ids=[other], expires_at=t.expires_at + 600)
        else:  # rebound: an attacker holding the secret points the hold at a victim's blocks
            victim = pair.hold(kind, n)
            holds.append(victim)
            if len(victim.blocks) != n:
                return
            bad = sign_ticket(msgspec.structs.replace(t, block_ids=victim.ticket.block_ids,
                                                      token=""), ctx.secret.encode())  # fmt: skip
    dest = pair.dest(n)
    run = P.start(pair, [bad], dest, seed, 5.0, holds=holds, must_fail=f"a {variant} ticket")
    if isinstance(run, str):
        ctx.tally.note(kind, f"refused:{run.split(':')[0]}")
    else:
        ctx.tally.note(kind, P.judge(pair, ctx.tally, kind, run))
    for contact in ctx.listener.take():
        ctx.tally.note(kind, "forged_peer_contacted")
        if contact.secret_seen:
            ctx.tally.violate(
                kind,
                "secret_leaks",
                f"{variant} ticket: the decode sent the peer secret to the listener",
            )


def healthy_pull(ctx: Ctx, kind: str) -> None:
    """A plain verified pull (warm-up, and to learn how long pulls take)."""
    n = ctx.rng.randint(200, MAX_BLOCKS)
    rec, run = _normal_pull(ctx, kind, n, 10.0)
    if run is None:
        return
    if P.judge(ctx.pair, ctx.tally, kind, run) == "done":
        ctx.learn_pull_s((time.monotonic() - run.started) * 750 / len(run.dest))
        ctx.done_tickets = [*ctx.done_tickets[-7:], rec.ticket]
