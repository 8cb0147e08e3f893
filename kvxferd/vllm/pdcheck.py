"""A prefill and a decode engine on vLLM's real Scheduler, KV allocation and KvxferdConnector,
each rank beside a real ``kvxferd serve``, requests flowing prefill -> params -> decode, every
pulled byte verified with kvxferd.pattern. CPU only (vLLM's model never runs: the scheduler gets
the model runner's outputs made up, the connector and the data plane are real).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvxferd import pattern
from kvxferd.layout import load_hf_config
from kvxferd.memory import SharedMemoryRegion
from kvxferd.sim import sidecars as launcher
from kvxferd.vllm import cpu
from kvxferd.vllm.connector import KvxferdConnector

TOKEN = "vllm-pd-check-secret"
_FILL = {  # what vLLM's config classes need that layout-only configs may lack (no weights load)
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "layer_norm_epsilon": 1e-5,
    "intermediate_size": 512,
}


@dataclass
class Report:
    """The --json answer."""

    model: str
    groups: list[str]
    verified: bool = True
    requests_ok: int = 0
    requests_failed: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    failures: list[str] = field(default_factory=list)


def model_dir(config: str, tmp: str) -> str:
    """A directory holding ``config`` (a path or a bundled name), filled with harmless
    defaults for fields vLLM's config classes need and a layout does not."""
    hf = load_hf_config(config)
    hf = {**_FILL, **hf}
    out = os.path.join(tmp, "model")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f)
    return out


class Rank:
    """One engine rank: vLLM's views over a shm segment, its worker-role connector (which talks
    to this rank's own sidecar: ``sidecar_socket`` with ``{rank}``, or the one given)."""

    def __init__(
        self, engine: cpu.Engine, layout: str, tp_rank: int = 0, *,
        sidecar_socket: str | None = None, fill: int | None = None, register: bool = True,
    ) -> None:  # fmt: skip
        """``register`` False: the caller calls :meth:`register` (a pod's ranks, at once)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        size = engine.kv_cache_config.kv_cache_tensors[0].size
        self.shm = SharedMemoryRegion.create(f"kvx-pd-{uuid.uuid4().hex[:8]}", size)
        if fill is not None:  # e.g. a sentinel, so bytes nobody wrote can be told apart
            self.shm.host_view()[:] = fill
        if sidecar_socket is not None:
            engine.config.kv_transfer_config.kv_connector_extra_config["sidecar_socket"] = (
                sidecar_socket
            )
        try:
            buf = torch.frombuffer(self.shm.host_view(), dtype=torch.int8)
            self.views = cpu.allocate(engine, layout, buffer=buf)
            with cpu.tp_rank(engine.config.parallel_config.tensor_parallel_size, tp_rank):
                self.connector = KvxferdConnector(
                    engine.config, KVConnectorRole.WORKER, engine.kv_cache_config
                )
        except BaseException:  # the segment goes with a rank that could not start
            self.shm.close()
            raise
        self.manifest: Any = None
        self.failed: set[str] = set()  # failed loads vLLM was told of (hybrids: no block ids)
        if register:
            self.register()

    def register(self) -> None:
        """vLLM's ``register_kv_caches`` (the rank is closed if it fails)."""
        try:
            self.connector.register_kv_caches(self.views)
        except BaseException:
            self.close()
            raise
        self.manifest = self.connector._worker.manifest

    def arrays(self) -> list[np.ndarray]:
        """Each manifest region's bytes."""
        host = self.shm.host_view()
        return [
            host[r.source_offset : r.source_offset + r.size_bytes] for r in self.manifest.regions
        ]

    def step(self, meta: Any) -> tuple[set[str] | None, set[str] | None]:
        """One worker step: the scheduler's metadata in, finished sets out."""
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()
        results = self.connector.get_transfer_results(set())
        self.failed |= results.failed_recving
        return results.finished_sending or None, results.finished_recving or None

    def close(self) -> None:
        self.connector.shutdown()
        self.shm.close()


def _scheduler(engine: cpu.Engine) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=engine.config,
        kv_cache_config=engine.kv_cache_config,
        structured_output_manager=StructuredOutputManager(engine.config),
        block_size=engine.config.cache_config.block_size,
    )


def request(
    rid: str, tokens: list[int], params: dict | None, block_size: int, max_tokens: int = 1
) -> Any:
    """A vLLM Request of ``tokens`` carrying ``params`` as its kv_transfer_params (in its
    sampling params' extra_args too, as vLLM's API server puts them)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = {"kv_transfer_params": params} if params else None
    req = Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = params
    return req


def step(sched: Any, connector_output: Any = None, token: int = 1) -> tuple[Any, dict]:
    """One scheduler step with made-up model outputs: ``token`` sampled for every request."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        kv_connector_output=connector_output,
    )
    return out, sched.update_from_output(out, mro)


def _bytes(manifest: Any, ids: list[list[int]]) -> tuple[int, int]:
    """(attention, state) bytes of the listed blocks of this rank."""
    kv = state = 0
    for group, gids in zip(manifest.groups, ids, strict=True):
        n = sum(1 for b in gids if b >= 0)
        ratio = group.block_size // group.kernel_block_size
        for layer in group.layers:
            parts = [layer.k, layer.v] if group.kind != "mamba" else [*layer.conv, layer.ssm]
            b = sum(p.units * p.rows * p.unit_bytes for p in parts) * n * ratio
            if group.kind == "mamba":
                state += b
            else:
                kv += b
    return kv, state


class Engine:
    """One engine: vLLM's scheduler and one Rank per TP rank, stepped together (``pod``: the
    ranks share a pod sidecar, so they register at once, as vLLM's workers do)."""

    def __init__(self, engine: cpu.Engine, layout: str, pod: bool = False) -> None:
        tp = engine.config.parallel_config.tensor_parallel_size
        self.ranks: list[Rank] = []
        try:
            for r in range(tp):
                self.ranks.append(Rank(engine, layout, r, register=not pod))
            if pod:  # a pod's registers answer once every rank registered
                with ThreadPoolExecutor(tp) as pool:
                    for done in [pool.submit(rank.register) for rank in self.ranks]:
                        done.result()
        except BaseException:
            for rank in self.ranks:
                rank.close()
            raise
        self.sched = _scheduler(engine)

    def work(self, meta: Any) -> list[tuple[set[str] | None, set[str] | None]]:
        """Every worker runs this step's ``meta``: each rank's finished sets (a fast pull can
        end inside the very step that started it, so the caller must count these too)."""
        return [rank.step(meta) for rank in self.ranks]

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


class _Seen:
    """Per request, which ranks reported it (vLLM's KVOutputAggregator in small)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.seen: dict[str, set[int]] = {}

    def add(self, per_rank: list[set[str] | None]) -> set[str]:
        """Requests every rank has now reported."""
        done = set()
        for r, ids in enumerate(per_rank):
            for rid in ids or ():
                got = self.seen.setdefault(rid, set())
                got.add(r)
                if len(got) == self.ranks:
                    done.add(rid)
                    del self.seen[rid]
        return done


def _wait_all(
    ranks: list[Rank], which: int, meta_type: Any, deadline: float, first: list[tuple] = (),
) -> set[str] | None:  # fmt: skip
    """Step every rank with empty orders until each has reported a request (bounded); ``first``
    is what the ranks already answered this round (the step that started the pull)."""
    from kvxferd.vllm.scheduler import StepOrders

    seen = _Seen(len(ranks))
    if first and (done := seen.add([answer[which] for answer in first])):
        return done
    while time.monotonic() < deadline:
        done = seen.add([rank.step(meta_type(StepOrders()))[which] for rank in ranks])
        if done:
            return done
        time.sleep(0.01)
    return None


def run(
    config: str,
    *,
    requests: int = 4,
    num_blocks: int = 64,
    layout: str = "LBHNC",
    prompt_tokens: int = 300,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    timeout_s: float = 120.0,
    prefill_pod: bool = False,
) -> Report:
    """Move ``requests`` prompts from a prefill (TP ``prefill_tp``) to a decode engine (TP
    ``decode_tp``), one sidecar per rank (``prefill_pod``: the prefill's ranks share one pod
    sidecar, ``serve --pod-ranks``, and each request has one ticket); verify every byte on
    every decode rank."""
    from vllm.v1.outputs import KVConnectorOutput

    tmp = tempfile.mkdtemp(prefix="kvx-pd-")
    mdir = model_dir(config, tmp)
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    names = [] if prefill_pod else [f"p{r}" for r in range(prefill_tp)]
    names += [f"d{r}" for r in range(decode_tp)]
    start = {"token": TOKEN, "env": env, "merge_stderr": True, "die_with_parent": True}
    sidecars = launcher.start_sidecars(tmp, names, "--log-level", "warning", **start)
    if prefill_pod:  # one sidecar for every prefill rank
        try:
            flags = ["--log-level", "warning", "--pod-ranks", str(prefill_tp)]
            sidecars += launcher.start_sidecars(tmp, ["p"], *flags, **start)
        except BaseException:
            for s in sidecars:
                s.stop()
            raise
    os.environ["KVXFERD_PEER_TOKEN"] = TOKEN
    max_len = prompt_tokens + 16  # small: --num-blocks must cover one max-length request
    built: list[Engine] = []
    try:
        specs = [
            cpu.build(
                mdir,
                num_blocks=num_blocks,
                layout=layout,
                max_model_len=max_len,
                extra_config={"sidecar_socket": os.path.join(tmp, role + "{rank}.sock")}
                if role == "d" or not prefill_pod
                else {"sidecar_socket": os.path.join(tmp, "p.sock"), "pod": True},
                engine_id=name,
                tp_size=tp,
            )  # fmt: skip
            for role, name, tp in (("p", "prefill", prefill_tp), ("d", "decode", decode_tp))
        ]
        groups = specs[0].kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        report = Report(model=str(specs[0].config.model_config.architecture), groups=kinds)
        for spec, pod in zip(specs, (prefill_pod, False), strict=True):
            built.append(Engine(spec, layout, pod))
        prefill, decode = built
        bs = specs[0].config.cache_config.block_size
        for i in range(requests):
            rid = f"req-{i}"
            tokens = [int(t) for t in np.random.default_rng(i).integers(1, 1000, prompt_tokens)]
            prefill.sched.add_request(request(rid, tokens, {"do_remote_decode": True}, bs))
            out, eng_out = step(prefill.sched)
            outs = [o for eo in eng_out.values() for o in eo.outputs if o.kv_transfer_params]
            params = outs[0].kv_transfer_params
            if len(params["kvxferd_tickets"]) != (1 if prefill_pod else prefill_tp):
                report.verified = False
                report.failures.append(f"{rid}: {len(params['kvxferd_tickets'])} tickets")
            held = [list(g) for g in params["kvxferd_tickets"][0]["block_ids"]]
            for rank in prefill.ranks:
                pattern.write_pattern(rank.manifest, rank.arrays(), held, seed=1000 + i)
            meta_type = type(out.kv_connector_metadata)
            prefill.work(out.kv_connector_metadata)
            # vLLM builds a step's metadata before the step's outputs finish requests: the hold
            # the finished prefill minted rides in the next step's metadata.
            out, _ = step(prefill.sched)
            prefill.work(out.kv_connector_metadata)

            decode.sched.add_request(request(f"d-{i}", tokens, dict(params), bs))
            out, _ = step(decode.sched)
            pulls = out.kv_connector_metadata.orders.pulls
            started = decode.work(out.kv_connector_metadata)
            deadline = time.monotonic() + timeout_s
            recv = _wait_all(decode.ranks, 1, meta_type, deadline, started)
            errors = set().union(
                *(r.connector.get_block_ids_with_load_errors() for r in decode.ranks),
                *(r.failed for r in decode.ranks),
            )
            for r in decode.ranks:
                r.failed.clear()
            step(decode.sched, KVConnectorOutput(finished_recving=recv or set()))
            target = pulls[0].block_ids if pulls else [[] for _ in held]
            bad = next(
                (b for r in decode.ranks
                 if (b := pattern.verify_pattern(r.manifest, r.arrays(), target, 1000 + i))),
                None,
            )  # fmt: skip
            if recv is None or errors or bad is not None:
                report.requests_failed += 1
                report.verified = False
                report.failures.append(f"{rid}: {bad or errors or 'pull did not finish'}")
                continue
            for rank in decode.ranks:
                kv, state = _bytes(rank.manifest, target)
                report.kv_bytes += kv
                report.state_bytes += state
            report.requests_ok += 1
            sending = _wait_all(prefill.ranks, 0, meta_type, deadline)
            step(prefill.sched, KVConnectorOutput(finished_sending=sending or set()))
            decode.sched.finish_requests(f"d-{i}", _finished_status())
    finally:
        for engine in built:
            engine.close()
        for s in sidecars:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _finished_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


__all__ = ["Report", "run"]
