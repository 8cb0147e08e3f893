"""An engine rank beside a real sidecar, and the request the sidecar e2e tests move: four
fragmented blocks of a llama-3.1-8b pool, pulled into four other fragmented blocks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvxferd.pattern import write_pattern
from kvxferd.wire import HoldRequest, Manifest, PullRequest, PullStatus, Ticket
from tests.sidecar.harness import QUIET, EnginePool, ReleasedFeed, Sidecar, plan, start_sidecars

MODEL = "llama-3.1-8b"
NUM_BLOCKS = 9  # a request of 4 blocks, fragmented, twice over
PIDS = [[3, 1, 7, 5]]
"""The prefill's held blocks."""
DIDS = [[2, 8, 4, 6]]
"""The decode's blocks they are pulled into."""


class Engine:
    """A rank: its sidecar, manifest and pool in shared memory (``pool`` to reuse one across a
    sidecar restart), and a follower of the sidecar's released feed from its start."""

    def __init__(self, sidecar: Sidecar, model: str = MODEL, pool: EnginePool | None = None):
        self.sidecar = sidecar
        self.manifest = pool.manifest if pool is not None else Engine.plan(model)
        self.pool = pool if pool is not None else EnginePool(self.manifest)
        self.feed = ReleasedFeed(sidecar)

    @staticmethod
    def plan(model: str = MODEL) -> Manifest:
        """The manifest of a rank's pool."""
        return plan(model, num_blocks=NUM_BLOCKS)

    def register(self) -> Engine:
        with self.sidecar.client() as c:
            c.register(self.manifest, self.pool.specs())
        return self

    def hold(self, request_id: str, seed: int = 5, **kw: object) -> Ticket:
        """Fill PIDS with the pattern of ``seed`` and hold them."""
        write_pattern(self.manifest, self.pool.views, PIDS, seed=seed)
        with self.sidecar.client() as c:
            return c.hold(HoldRequest(request_id=request_id, block_ids=PIDS, num_tokens=60, **kw))

    def abort(self, ticket: Ticket) -> None:
        with self.sidecar.client() as c:
            c.abort(ticket.hold_id)

    def pull(self, tickets: list[Ticket], timeout_s: float = 60.0) -> PullStatus:
        """Pull ``tickets`` into DIDS and wait (bounded) for the outcome."""
        with self.sidecar.client() as c:
            accepted = c.pull(PullRequest(tickets=tickets, block_ids=DIDS, deadline_s=timeout_s))
            return c.wait_pull(accepted.pull_id, timeout_s=timeout_s + 30)

    def released_once(self, ticket: Ticket, reason: str) -> None:
        """The hold shows up in the feed exactly once, with ``reason``."""
        assert self.feed.wait_for(ticket.hold_id) == {ticket.hold_id: reason}
        assert self.feed.count(ticket.hold_id) == 1

    def close(self) -> None:
        self.pool.close()


@contextlib.contextmanager
def engine_pair(tmp: str, *extra: str) -> Iterator[tuple[Engine, Engine]]:
    """A registered prefill and decode, each beside its own ``kvxferd serve`` (``extra``
    flags, no progress thread); on the way out both sidecars must stop cleanly (exit 0)."""
    p, d = start_sidecars(tmp, ["prefill", "decode"], *extra, env=QUIET)
    engines = (Engine(p), Engine(d))
    try:
        for e in engines:
            e.register()
        yield engines
    finally:
        codes = [p.stop(), d.stop()]
        for e in engines:
            e.close()
    assert codes == [0, 0]
