"""An engine rank for the worker-side tests: vLLM's own ``allocate_kv_cache`` views placed in a
POSIX shared-memory segment (so a real sidecar maps them) and a worker-role KvxferdConnector."""

from __future__ import annotations

import uuid

import numpy as np
import torch

from kvxferd.memory import SharedMemoryRegion
from kvxferd.vllm.connector import KvxferdConnector, KvxferdMetadata
from tests.sidecar.harness import SENTINEL


class Rank:
    """One engine rank (``tp_rank`` of the engine's TP size): vLLM's views over a shm segment and
    its connector (worker role)."""

    def __init__(self, engine, layout: str, sidecar, tp_rank: int = 0) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvxferd.vllm import cpu

        size = engine.kv_cache_config.kv_cache_tensors[0].size
        self.shm = SharedMemoryRegion.create(f"kvx-vllm-{uuid.uuid4().hex[:8]}", size)
        self.shm.host_view()[:] = SENTINEL
        buf = torch.frombuffer(self.shm.host_view(), dtype=torch.int8)
        self.views = cpu.allocate(engine, layout, buffer=buf)
        extra = engine.config.kv_transfer_config.kv_connector_extra_config
        extra["sidecar_socket"] = sidecar.socket
        with cpu.tp_rank(engine.config.parallel_config.tensor_parallel_size, tp_rank):
            self.connector = KvxferdConnector(
                engine.config, KVConnectorRole.WORKER, engine.kv_cache_config
            )
        self.connector.register_kv_caches(self.views)
        self.manifest = self.connector._worker.manifest

    def arrays(self) -> list[np.ndarray]:
        host = self.shm.host_view()
        return [
            host[r.source_offset : r.source_offset + r.size_bytes] for r in self.manifest.regions
        ]

    def step(self, orders) -> tuple:
        self.connector.bind_connector_metadata(KvxferdMetadata(orders))
        self.connector.start_load_kv(None)
        self.connector.clear_connector_metadata()
        return self.connector.get_finished(set())

    def close(self) -> None:
        self.connector.shutdown()
        self.shm.close()


def request(rid: str, n: int, params: dict | None, block_size: int = 128, *,
            prompt: list[int] | None = None, max_tokens: int = 1):  # fmt: skip
    """A vLLM Request of ``n`` prompt tokens (1..n, or ``prompt``) carrying ``params`` as its
    kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)

    sp = SamplingParams(
        max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None
    )
    req = Request(request_id=rid, prompt_token_ids=prompt or list(range(1, n + 1)),
                  sampling_params=sp,
                  pooling_params=None,
                  block_hasher=get_request_block_hasher(block_size, sha256))  # fmt: skip
    req.kv_transfer_params = params
    return req


def step(sched, connector_output=None):
    """One scheduler step with made-up model outputs (one sampled token per request)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=connector_output,
    )
    return out, sched.update_from_output(out, mro)
