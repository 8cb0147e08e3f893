"""An engine "process" with the store on, for the connector's store tests: vLLM's real
Scheduler, a worker-role connector per rank, and beside them a ``kvxferd serve`` per rank (or one
pod sidecar for every rank, ``"pod": true``) on one store directory."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from kvxferd import pattern
from tests.sidecar.harness import changed_outside, start_sidecars
from tests.vllm.ranks import Rank, request, step

CHUNK, SEED, LAYOUT = 64, 23, "LBHNC"


def scheduler(engine):  # noqa: ANN001, ANN201
    """vLLM's own Scheduler over ``engine`` (its connector in the scheduler role)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=engine.config,
        kv_cache_config=engine.kv_cache_config,
        structured_output_manager=StructuredOutputManager(engine.config),
        block_size=engine.config.cache_config.block_size,
    )


class Engine:
    """One engine "process": a sidecar per rank on the store directory (``pod``: one pod
    sidecar, ``serve --pod-ranks N``, every rank registered on it at once), the worker ranks, a
    scheduler (its connector reaches rank r's sidecar at ``NAME-r.sock``, or the pod's)."""

    def __init__(self, engine, tmp_path, name: str, store: str = "both", pod: bool = False
                 ) -> None:  # fmt: skip
        tp = engine.config.parallel_config.tensor_parallel_size
        ext = engine.config.kv_transfer_config.kv_connector_extra_config
        flags = ("--store-dir", str(tmp_path / "store"), "--store-chunk-tokens", str(CHUNK))
        if pod:
            self.sidecars = start_sidecars(str(tmp_path), [name], "--pod-ranks", str(tp), *flags)
            ext["pod"] = True
        else:
            self.sidecars = start_sidecars(str(tmp_path), [f"{name}-{r}" for r in range(tp)],
                                           *flags)  # fmt: skip
        self.sidecar = self.sidecars[0]
        ext.update(store=store, store_chunk_tokens=CHUNK)
        self.ranks: list[Rank] = []
        try:
            for r in range(tp):
                side = self.sidecars[0 if pod else r]
                self.ranks.append(Rank(engine, LAYOUT, side, tp_rank=r, register=not pod))
            if pod:  # a pod's registers answer together: every rank's at once
                with ThreadPoolExecutor(tp) as workers:
                    for done in [workers.submit(r.register) for r in self.ranks]:
                        done.result(timeout=60)
            ext["sidecar_socket"] = (self.sidecar.socket if pod
                                     else str(tmp_path / f"{name}-{{rank}}.sock"))  # fmt: skip
            self.sched = scheduler(engine)
        except BaseException:
            self.close()
            raise
        self.rank = self.ranks[0]
        self.block_size = engine.config.cache_config.block_size

    def step(self, orders) -> list[tuple]:  # noqa: ANN001
        """Every rank's worker runs the step's orders: their get_finished answers."""
        return [rank.step(orders) for rank in self.ranks]

    def run(self, rid: str, prompt: list[int], max_tokens: int = 1):  # noqa: ANN201
        """Run a request from nothing to its end; the save order it leaves (blocks filled with
        the token pattern first, as the model would have computed them), then run."""
        self.sched.add_request(request(rid, len(prompt), None, self.block_size, prompt=prompt,
                                       max_tokens=max_tokens))  # fmt: skip
        for _ in range(max_tokens):
            out, _ = step(self.sched)
            assert out.kv_connector_metadata.orders.loads == []  # nothing in the store yet
            self.step(out.kv_connector_metadata.orders)
        out, _ = step(self.sched)
        orders = out.kv_connector_metadata.orders
        for save in orders.saves:
            for rank in self.ranks:
                pattern.write_token_pattern(rank.manifest, rank.arrays(), save.block_ids,
                                            save.num_tokens, SEED)  # fmt: skip
        assert set(self.step(orders)) == {(None, None)}
        return orders.saves

    def close(self) -> None:
        if getattr(self, "sched", None) is not None:
            self.sched.shutdown()  # closes the scheduler connector's lookup client
        for rank in self.ranks:
            rank.close()
        for side in self.sidecars:
            assert side.stop() == 0


def admit_load(eng: Engine, rid: str, prompt: list[int]):  # noqa: ANN201
    """Admit a request; its load order, every rank's memory before the load, and the workers'
    answer to it (the same on every rank; bytes checked by the caller)."""
    from vllm.v1.request import RequestStatus

    eng.sched.add_request(request(rid, len(prompt), None, eng.block_size, prompt=prompt))
    out, _ = step(eng.sched)
    assert eng.sched.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loads = out.kv_connector_metadata.orders.loads
    assert [ld.request_id for ld in loads] == [rid]
    before = [[a.copy() for a in rank.arrays()] for rank in eng.ranks]
    answers = eng.step(out.kv_connector_metadata.orders)
    assert all(a == answers[0] for a in answers)  # every rank loads the same order
    return loads[0], before, answers[0]


def check_loaded(eng: Engine, load, num_tokens: int, before) -> None:  # noqa: ANN001
    """On every rank: no load errors, the loaded blocks hold the saved bytes of ``num_tokens``
    (every layer, every block), and nothing outside them changed since ``before``."""
    for rank, was in zip(eng.ranks, before, strict=True):
        assert rank.connector.get_block_ids_with_load_errors() == set()
        assert pattern.verify_token_pattern(rank.manifest, rank.arrays(), load.block_ids,
                                            num_tokens, SEED) is None  # fmt: skip
        assert changed_outside(was, rank.arrays(), rank.manifest, load.block_ids) == 0


def computes_only_the_tail(eng: Engine, rid: str) -> None:
    """The workers report ``rid``'s load done; vLLM then schedules only its last token."""
    from vllm.v1.outputs import KVConnectorOutput

    step(eng.sched, KVConnectorOutput(finished_recving={rid}))
    out, _ = step(eng.sched)
    assert out.num_scheduled_tokens.get(rid, 0) == 1  # only the tail is computed
