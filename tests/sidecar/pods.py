"""A pod sidecar (``--pod-ranks N``) in this process beside the N ranks of one engine, each rank's
pool in POSIX shm: every rank registers (the registers answer once all did), and a hold is placed
by every rank. Driven directly on one event loop, as tests/sidecar/inprocess.py drives a rank's.

For a decode-side test that pulls from a pod: :func:`pod_process` (a real ``kvxferd serve
--pod-ranks N`` with every rank registered over its engine socket) and :func:`hold_ranks` (the
blocks PIDS filled with ``kvxferd.pattern`` of ``seed``, each rank's own, then the hold placed
by every rank) give the one signed pod ticket; ``PodPools.manifests[r]`` and
``PodPools.pools[r].views`` are what rank r holds (``verify_pattern`` against them). In this
process: :func:`run_pod` with ``registered=True``, then :func:`hold_on_all`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvxferd.config import Config
from kvxferd.layout import PlanOptions, load_hf_config
from kvxferd.pattern import write_pattern
from kvxferd.sidecar.service import Sidecar
from kvxferd.sim.kvpool import plan_ranks
from kvxferd.wire import HoldRequest, Manifest, RegisterRequest, RegisterResponse, Ticket
from tests.sidecar.harness import QUIET, TOKEN, EnginePool, SidecarProcess, start_sidecar

MODEL = "llama-3.1-8b"
NUM_BLOCKS = 8
PIDS = [[3, 1, 7, 5]]
"""The blocks a pod test holds (fragmented)."""
NUM_TOKENS = 60


class PodPools:
    """The pools of every rank of one TP ``ranks`` engine (planned by the planner, region names
    unique to this run: each rank's segments are its own)."""

    def __init__(self, ranks: int, model: str = MODEL, num_blocks: int = NUM_BLOCKS) -> None:
        options = PlanOptions(tp_size=ranks, num_blocks=num_blocks,
                              engine_id=f"p{uuid.uuid4().hex[:8]}")  # fmt: skip
        self.manifests: list[Manifest] = plan_ranks(load_hf_config(model), options)
        self.pools: list[EnginePool] = []
        try:
            for manifest in self.manifests:
                self.pools.append(EnginePool(manifest))
        except BaseException:
            self.close()
            raise

    @property
    def ranks(self) -> int:
        return len(self.manifests)

    def request(self, rank: int, manifest: Manifest | None = None, **kw: Any) -> RegisterRequest:
        """Rank ``rank``'s register (its own manifest unless ``manifest``)."""
        return RegisterRequest(manifest=manifest or self.manifests[rank],
                               regions=self.pools[rank].specs(), **kw)  # fmt: skip

    def fill(self, block_ids: list[list[int]], seed: int) -> None:
        """Write the byte pattern of ``seed`` into ``block_ids`` of every rank (each rank's
        pattern is its own: the pattern follows the rank's units)."""
        for manifest, pool in zip(self.manifests, self.pools, strict=True):
            write_pattern(manifest, pool.views, block_ids, seed=seed)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


PodScenario = Callable[[Sidecar, PodPools], Awaitable[None]]


def run_pod(scenario: PodScenario, *, ranks: int, engine_id: str, registered: bool = False,
            peer_address: str = "127.0.0.1:9", **config: Any) -> None:  # fmt: skip
    """Run ``scenario(sidecar, pools)`` with a pod sidecar of ``ranks`` ranks (``registered``:
    every rank registered first); the sidecar is closed and the pools unmapped on the way out,
    whatever happens."""
    pools = PodPools(ranks)
    sidecar = Sidecar(Config(peer_token=TOKEN, engine_id=engine_id, pod_ranks=ranks, **config))
    sidecar.peer_address = peer_address

    async def main() -> None:
        try:
            if registered:
                await register_all(sidecar, pools)
            await scenario(sidecar, pools)
        finally:
            await sidecar.close()

    try:
        asyncio.run(main())
    finally:
        pools.close()


async def register_all(sidecar: Sidecar, pools: PodPools) -> list[RegisterResponse]:
    """Every rank's register at once (bounded); their answers, rank order."""
    async with asyncio.timeout(60):
        return list(await asyncio.gather(
            *(sidecar.register(pools.request(r)) for r in range(pools.ranks))
        ))  # fmt: skip


def hold_request(rank: int, generation: int, hold_id: str = "pod-h1", **kw: Any) -> HoldRequest:
    """Rank ``rank``'s placement of hold ``hold_id`` (request r1, PIDS, NUM_TOKENS)."""
    terms: dict[str, Any] = {"request_id": "r1", "block_ids": PIDS, "num_tokens": NUM_TOKENS}
    return HoldRequest(hold_id=hold_id, tp_rank=rank, generation=generation, **{**terms, **kw})


def hold_on_all(sidecar: Sidecar, pools: PodPools, *, hold_id: str = "pod-h1",
                seed: int = 5) -> Ticket:  # fmt: skip
    """Fill PIDS of every rank with the pattern of ``seed`` and place hold ``hold_id`` on every
    rank, rank order; the pod's ticket (every rank's answer, checked to be the same)."""
    pools.fill(PIDS, seed)
    tickets = [sidecar.hold(hold_request(r, sidecar.generation, hold_id))
               for r in range(pools.ranks)]  # fmt: skip
    assert all(t == tickets[0] for t in tickets), tickets
    return tickets[0]


async def until(predicate: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Let the loop run until ``predicate()`` holds (bounded: AssertionError naming ``what``)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None


# ------------------------------------------------------------------------------------------------
# The same over a real ``kvxferd serve --pod-ranks N`` process (its engine socket, every rank's
# calls from its own client, as the pod's N workers make them)
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def pod_process(
    tmp_dir: str, ranks: int, *extra: str, name: str = "pod", env: dict[str, str] | None = None
) -> Iterator[tuple[SidecarProcess, PodPools]]:
    """A ``kvxferd serve --pod-ranks ranks`` child (``extra`` flags, no progress thread unless
    ``env`` says) with every rank of a fresh pool registered; on the way out it must stop
    cleanly (exit 0)."""
    sidecar = start_sidecar(tmp_dir, name, "--pod-ranks", str(ranks), *extra,
                            env={**QUIET, **(env or {})})  # fmt: skip
    pools = PodPools(ranks)
    try:
        register_ranks(sidecar, pools)
        yield sidecar, pools
    finally:
        code = sidecar.stop()
        pools.close()
    assert code == 0


def register_ranks(sidecar: SidecarProcess, pools: PodPools, timeout_s: float = 60.0) -> list:
    """Every rank's register on the engine socket at once, each from its own thread and client
    (each answers only once all did); the answers, rank order."""

    def one(rank: int) -> RegisterResponse:
        with sidecar.client(timeout_s=timeout_s) as c:
            req = pools.request(rank)
            return c.register(req.manifest, req.regions, instance=f"rank-{rank}")

    with ThreadPoolExecutor(pools.ranks) as ex:
        futures = [ex.submit(one, r) for r in range(pools.ranks)]
        return [f.result(timeout=timeout_s + 10) for f in futures]


def hold_ranks(sidecar: SidecarProcess, pools: PodPools, generation: int, *,
               hold_id: str = "pod-h1", seed: int = 5, **kw: Any) -> Ticket:  # fmt: skip
    """Fill PIDS of every rank with the pattern of ``seed`` and place hold ``hold_id`` from
    every rank's client (rank order): the pod's ticket, every rank's answer checked the same."""
    pools.fill(PIDS, seed)
    tickets = []
    for rank in range(pools.ranks):
        with sidecar.client() as c:
            tickets.append(c.hold(hold_request(rank, generation, hold_id, **kw)))
    assert all(t == tickets[0] for t in tickets), tickets
    return tickets[0]
