"""KvxferdConnector: vLLM 0.33's KV connector interface over one kvxferd sidecar per rank, or
over one pod sidecar for every rank of a prefill engine.

``kv_connector_extra_config``: ``sidecar_socket`` (a path with ``{rank}``), ``peer_token_file``
(else ``KVXFERD_PEER_TOKEN``), ``partial_prefill`` (default: on for Mamba hybrids), and the
store's ``store``, ``store_order``, ``store_chunk_tokens``, ``store_lookup_timeout_s``,
``store_namespace`` (kvxferd.vllm.storeplan.StoreOptions).

``"pod": true`` (default false): the engine's TP workers share one pod sidecar (``kvxferd serve
--pod-ranks N``, N the TP size; ``sidecar_socket`` one path without ``{rank}``, default
``/run/kvxferd/engine.sock``). The setting is explicit, not read from the sidecar's identity,
so the scheduler knows before any call how many identities to read; each worker checks the
identity against it at start (ConfigError either way: a pod sidecar without ``"pod"``, a rank
sidecar or a pod of another size with it). Then every worker registers its own rank on the one
socket (the registers answer together, one generation; each worker holds its own engine lock,
``<socket>.engine.lock.<rank>``) under an instance id the engine's workers share; the scheduler
reads the one identity and mints one ticket per request (``ranks`` N), which the
``kv_transfer_params`` carry alone; every worker places each hold under the scheduler's hold id
with its ``tp_rank`` and reads the released feed with its own cursor. Sleep: the first worker's
unregister ends the pod, the others wait until it has gone (their memory stays registered until
then); wake-up: every worker registers again and the registers pair up at the sidecar. A worker
refused as not registered (an unregister behind the engine) registers again at its next refused
call, as with a rank's own sidecar; its register waits for the other ranks' (at most the
sidecar's ``--pod-register-timeout``, then it tries again at its next refused call). With the
store, every worker saves and loads its own rank's blocks through the pod (naming its
``tp_rank``) and the scheduler looks up rank 0's. Refused at start with a pod (ConfigError):
``{rank}`` in the socket, TP 1, ``kv_role`` kv_consumer; a decode request that reaches a pod
engine is computed locally (its tickets declined).
A decode engine pulls from a pod with its own sidecar per rank, as from any prefill.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvxferd.client import EngineClient, frames_available
from kvxferd.errors import ConfigError
from kvxferd.vllm import pod as pods
from kvxferd.vllm.manifest import ConvGeometry, conv_geometry
from kvxferd.vllm.scheduler import SchedulerSide, StepOrders
from kvxferd.vllm.storeplan import StoreOptions, StorePlanner
from kvxferd.vllm.weights import fingerprint
from kvxferd.vllm.worker import REGISTER_RETRY_S, WorkerSide
from kvxferd.wire import StoreLookup, StoreLookupRequest

DEFAULT_SOCKET = "/run/kvxferd/engine-{rank}.sock"


class KvxferdMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler to every worker."""

    def __init__(self, orders: StepOrders) -> None:
        self.orders = orders


class KvxferdWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, per step: ranks whose sidecar no longer matches minted tickets."""

    def __init__(self, stale_ranks: set[int]) -> None:
        self.stale_ranks = stale_ranks

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The union over every worker of the step."""
        ranks = getattr(other, "stale_ranks", set())
        return KvxferdWorkerMetadata(self.stale_ranks | ranks)


def _group_kinds(kv_cache_config: Any) -> list[str] | None:
    """ "mamba" or "attention" per KV-cache group (None without a kv-cache config)."""
    if kv_cache_config is None:
        return None
    return [
        "mamba" if type(g.kv_cache_spec).__name__ == "MambaSpec" else "attention"
        for g in kv_cache_config.kv_cache_groups
    ]


def _conv_geometry(vllm_config: Any, tp_size: int) -> ConvGeometry:
    """The conv-state layout vLLM uses (VLLM_SSM_CONV_STATE_LAYOUT) and the model's sections."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    hf = vllm_config.model_config.hf_config
    return conv_geometry(hf.to_dict(), tp_size, get_conv_state_layout())


def store_root(vllm_config: Any, namespace: str | None = None) -> bytes:
    """What besides the tokens decides the KV bytes of an engine, as the store keys' root: the
    model (path, revision, the weights themselves: ``namespace`` or else their files' or hub
    commit's fingerprint, kvxferd.vllm.weights; weights dtype, quantization, its config with any
    overrides) and the cache dtypes (fp8_e4m3 and fp8_e5m2 share one manifest dtype, not one
    meaning). ``namespace`` None: the connector config's ``store_namespace``."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if namespace is None:
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        namespace = StoreOptions.from_extra(extra).namespace
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    weights = f"namespace:{namespace}" if namespace else fingerprint(mc, download_dir)
    parts = {
        "model": str(mc.model),
        "revision": str(mc.revision),
        "weights": weights,
        "dtype": str(mc.dtype),
        "quantization": str(mc.quantization),
        "hf_config": mc.hf_config.to_json_string(),
        "cache_dtype": str(cc.cache_dtype),
        "mamba_cache_dtype": str(getattr(cc, "mamba_cache_dtype", "")),
        "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "")),
        "kv_cache_dtype_skip_layers": sorted(getattr(cc, "kv_cache_dtype_skip_layers", []) or []),
    }
    return b"kvxferd-store/1\0" + json.dumps(parts, sort_keys=True).encode()


def _secret(extra: dict[str, Any]) -> bytes:
    path = extra.get("peer_token_file") or os.environ.get("KVXFERD_PEER_TOKEN_FILE")
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    return os.environ.get("KVXFERD_PEER_TOKEN", "").encode()


def _check_parallelism(parallel: Any) -> None:
    """ConfigError for layouts whose ranks would share a sidecar: ``{rank}`` in
    ``sidecar_socket`` names only the TP rank, and a second engine on a sidecar's socket would
    take its registration from the first."""
    for field in ("pipeline_parallel_size", "data_parallel_size_local"):
        if (size := getattr(parallel, field, 1) or 1) > 1:
            raise ConfigError(
                f"{field}={size} is not supported: {{rank}} in sidecar_socket names the TP "
                "rank only, so ranks would share a sidecar; run one engine per pod with tensor "
                "parallelism only (data parallel across pods)"
            )


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector vLLM loads by ``kv_connector_module_path: kvxferd.vllm``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _check_parallelism(vllm_config.parallel_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._store_options = StoreOptions.from_extra(extra)
        if not isinstance(extra.get("partial_prefill", False), bool):  # "false" would be on
            raise ConfigError(f"partial_prefill: expected true or false, got "
                              f"{extra['partial_prefill']!r:.40}")  # fmt: skip
        self._pod = pods.check_config(extra, tp_size=tp_size,
                                      kv_role=str(self._kv_transfer_config.kv_role))  # fmt: skip
        default = pods.DEFAULT_POD_SOCKET if self._pod else DEFAULT_SOCKET
        self._socket = extra.get("sidecar_socket", default)
        self._lookup_client: EngineClient | None = None
        if role == KVConnectorRole.SCHEDULER:
            hybrid = bool(vllm_config.model_config.is_hybrid)
            store = None
            if self._store_options.mode != "off":
                store = StorePlanner(
                    self._store_options,
                    self._store_lookup,
                    root=store_root(vllm_config, self._store_options.namespace),
                    kinds=_group_kinds(kv_cache_config),
                    block_size=vllm_config.cache_config.block_size,
                )
            self._sched = SchedulerSide(
                engine_id=str(self._kv_transfer_config.engine_id),
                tp_size=tp_size,
                secret=_secret(extra),
                identities=lambda: self._read_identities(tp_size),
                block_size=vllm_config.cache_config.block_size,
                partial_prefill=extra.get("partial_prefill", hybrid),
                group_kinds=_group_kinds(kv_cache_config),
                store=store,
                pod=self._pod,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = WorkerSide(
                self._socket if self._pod else self._socket.format(rank=rank),
                model=vllm_config.model_config.model,
                tp_rank=rank,
                tp_size=tp_size,
                conv=_conv_geometry(vllm_config, tp_size),
                pod=self._pod,
                instance=pods.shared_instance(vllm_config) if self._pod else None,
            )

    def _read_identities(self, tp_size: int) -> list[Any]:
        """Each rank's sidecar identity (a pod's: the one)."""
        if self._pod:
            with EngineClient(self._socket, timeout_s=5.0) as client:
                return [client.identity()]
        out = []
        for rank in range(tp_size):
            with EngineClient(self._socket.format(rank=rank), timeout_s=5.0) as client:
                out.append(client.identity())
        return out

    def _store_lookup(self, req: StoreLookupRequest) -> StoreLookup:
        """A store lookup at rank 0's sidecar (or the pod), bounded by
        ``store_lookup_timeout_s`` (one kept client)."""
        if self._lookup_client is None:
            path = self._socket.format(rank=0)
            self._lookup_client = EngineClient(
                path, timeout_s=self._store_options.lookup_timeout_s,
                frames=frames_available(path),
            )  # fmt: skip
        return self._lookup_client.store_lookup(req)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Sleep unregisters the KV cache from the sidecar; wake registers it again."""
        return True

    # ---------------------------------------------------------------- scheduler side

    def on_new_request(self, request: Any) -> None:
        assert self._sched is not None
        self._sched.new_request(request)
        self._sched.queued(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        assert self._sched is not None
        return self._sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return KvxferdMetadata(self._sched.take_orders())

    def request_finished(self, request: Any, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        assert self._sched is not None
        return self._sched.finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        """A worker found its sidecar restarted or re-registered: re-read identities."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._sched is not None and isinstance(meta, KvxferdWorkerMetadata):
            self._sched.stale(meta.stale_ranks)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        heads = self._vllm_config.model_config.get_total_num_kv_heads()
        self._worker.register(kv_caches, self._kv_cache_config, heads, no_answer_s=REGISTER_RETRY_S)

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM has drained transfers): the sidecar lets go of the memory, and
        tickets of this registration generation are refused from now on. Idempotent."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake-up: register the same tensors again, under a new generation."""
        if self._worker is not None:
            self._worker.restore()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvxferdMetadata):
            self._worker.run(meta.orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # the decode side pulls; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]):
        if self._worker is None:
            return None, None
        return self._worker.finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` and, where block ids are per group (hybrid models: vLLM refuses
        block-level load errors for them), the requests whose load failed."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed if self._several_groups() else set(),
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None or not self._worker.take_stale():
            return None
        return KvxferdWorkerMetadata({self._worker.tp_rank})

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker.load_errors() if self._worker is not None else set()
        return set() if self._several_groups() else errors  # then failed_recving says it

    def _several_groups(self) -> bool:
        config = self._kv_cache_config
        return config is not None and len(config.kv_cache_groups) > 1

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._lookup_client is not None:
            self._lookup_client.close()
