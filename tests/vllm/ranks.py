"""An engine rank for the worker-side tests: vLLM's own ``allocate_kv_cache`` views placed in a
POSIX shared-memory segment (so a real sidecar maps them) and a worker-role KvxferdConnector."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

from kvxferd.vllm import pdcheck
from kvxferd.vllm.connector import KvxferdMetadata
from kvxferd.vllm.scheduler import TRUNCATED, SchedulerSide
from tests.sidecar.harness import SENTINEL, TOKEN, Sidecar, start_sidecars, wait_until


class Rank(pdcheck.Rank):
    """One engine rank (``tp_rank`` of the engine's TP size) beside ``sidecar``: vLLM's views
    over a shm segment filled with SENTINEL, and its connector (worker role)."""

    def __init__(self, engine, layout: str, sidecar, tp_rank: int = 0, *,
                 register: bool = True) -> None:  # fmt: skip
        super().__init__(engine, layout, tp_rank, sidecar_socket=sidecar.socket, fill=SENTINEL,
                         register=register)  # fmt: skip

    def step(self, orders) -> tuple:
        return super().step(KvxferdMetadata(orders))


def step_until(rank: Rank, orders, which: int, timeout: float, what: str) -> set[str]:
    """Step ``rank`` with ``orders``, then with empty orders until its finished set ``which``
    (0: holds released, 1: pulls ended) is non-empty. The first step's answer counts: a fast
    pull can end inside the very step that started it."""
    got = rank.step(orders)[which]
    return got or wait_until(lambda: rank.step(type(orders)())[which], timeout, what)


@contextlib.contextmanager
def worker_pair(tmp_path, layout: str, prefill_engine, decode_engine=None, *, flags=()
                ) -> Iterator[tuple[Rank, Rank, Sidecar]]:  # fmt: skip
    """A prefill and a decode rank (one engine for both unless two are given), each beside its
    own ``kvxferd serve`` ("p", "d", both with ``flags``): (prefill, decode, the prefill's
    sidecar). Everything is closed and stopped on the way out."""
    p_side, d_side = start_sidecars(str(tmp_path), ["p", "d"], *flags)
    ranks: list[Rank] = []
    try:
        ranks.append(Rank(prefill_engine, layout, p_side))
        ranks.append(Rank(decode_engine or prefill_engine, layout, d_side))
        yield ranks[0], ranks[1], p_side
    finally:
        for rank in ranks:
            rank.close()
        p_side.stop()
        d_side.stop()


def prefill_side(identities, block_size: int, *, tp_size: int = 1, partial_prefill: bool = False,
                 **kw) -> SchedulerSide:  # fmt: skip
    """The scheduler side of prefill engine "P" (the test secret), minting from ``identities``."""
    return SchedulerSide(engine_id="P", tp_size=tp_size, secret=TOKEN.encode(),
                         identities=identities, block_size=block_size,
                         partial_prefill=partial_prefill, **kw)  # fmt: skip


def finish(sched: SchedulerSide, rid: str, block_ids, n: int) -> tuple[bool, dict | None]:
    """The prefill finishes ``rid`` (``n`` prompt tokens) on ``block_ids`` (per group): whether
    its blocks wait for the hold, and the kv_transfer_params it returns. With partial prefill,
    its last token was dropped when it came (``SchedulerSide.new_request``)."""
    params = {"do_remote_decode": True}
    if sched.partial_prefill:
        n, params[TRUNCATED] = n - 1, True
    req = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(n)),
                          kv_transfer_params=params,
                          status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))  # fmt: skip
    return sched.finished(req, tuple(block_ids))


def request(rid: str, n: int, params: dict | None, block_size: int = 128, *,
            prompt: list[int] | None = None, max_tokens: int = 1):  # fmt: skip
    """A vLLM Request of ``n`` prompt tokens (1..n, or ``prompt``) carrying ``params`` as its
    kv_transfer_params."""
    tokens = prompt or list(range(1, n + 1))
    return pdcheck.request(rid, tokens, params, block_size, max_tokens)


def step(sched, connector_output=None):
    """One scheduler step with made-up model outputs (token 7 sampled for every request)."""
    return pdcheck.step(sched, connector_output, token=7)
