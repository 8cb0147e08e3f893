"""vLLM's own configuration, KV-cache planning and allocation, run on a CPU-only machine.

For tests and ``scripts/vllm_pd_check.py``: the model is built on the meta device (no weights),
so its layers report their real KV-cache specs and vLLM's platform code sets the real block size
and Mamba page padding; vLLM's planner then groups the layers and its ``allocate_kv_cache``
makes the tensors a worker would hand ``register_kv_caches``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # keeps the hybrid allocator on
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

_DIST_READY = False


@dataclass
class Engine:
    """One engine's vLLM config, the layers' specs and the kv-cache config of every rank."""

    config: VllmConfig
    specs: dict[str, Any]
    kv_cache_config: Any


def engine_config(
    model_dir: str,
    *,
    num_blocks: int,
    max_model_len: int = 1024,
    prefix_caching: bool = True,
    extra_config: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
    engine_id: str | None = None,
    tp_size: int = 1,
    block_size: int | None = None,
) -> VllmConfig:
    """A VllmConfig for ``model_dir/config.json`` with the kvxferd connector configured
    (``block_size`` None: the platform's choice)."""
    args = EngineArgs(
        model=model_dir,
        tensor_parallel_size=tp_size,
        block_size=block_size,
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=max(2048, max_model_len),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxferdConnector",
            kv_connector_module_path="kvxferd.vllm",
            kv_role=kv_role,
            engine_id=engine_id,
            kv_connector_extra_config=extra_config or {},
        ),
    )
    return args.create_engine_config()


def _init_distributed(config: VllmConfig) -> None:
    """A one-process gloo world; model-parallel groups made anew for each model (MoE needs EP)."""
    global _DIST_READY
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.utils.network_utils import get_open_port

    if _DIST_READY:
        destroy_model_parallel()
    else:
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
            backend="gloo",
        )
        _DIST_READY = True
    initialize_model_parallel(1, 1)


@contextlib.contextmanager
def tp_rank(tp_size: int, rank: int) -> Iterator[None]:
    """Make this one process look like rank ``rank`` of ``tp_size`` to vLLM's parallel state
    (what a layer's KV-cache spec and the connector's worker side read), then restore it."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    saved = group.world_size, group.rank_in_group
    group.world_size, group.rank_in_group = tp_size, rank
    try:
        yield
    finally:
        group.world_size, group.rank_in_group = saved


def layer_specs(config: VllmConfig) -> dict[str, Any]:
    """Build the model on the meta device; vLLM sets block sizes; each layer's KV-cache spec."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    cls, _ = ModelRegistry.resolve_model_cls(config.model_config.architectures, config.model_config)
    with set_current_vllm_config(config):
        _init_distributed(config)
        old = torch.get_default_dtype()
        torch.set_default_dtype(config.model_config.dtype)
        tp_size = config.parallel_config.tensor_parallel_size
        with tp_rank(tp_size, 0):  # every rank has the same specs
            try:
                with torch.device("meta"):
                    cls(vllm_config=config, prefix="")
            finally:
                torch.set_default_dtype(old)
            current_platform.update_block_size_for_backend(config)
            specs = {}
            for name, layer in config.compilation_config.static_forward_context.items():
                get_spec = getattr(layer, "get_kv_cache_spec", None)  # MoE runners live here too
                spec = get_spec(config) if get_spec is not None else None
                if spec is not None:
                    specs[name] = spec
    return specs


def plan(config: VllmConfig, specs: dict[str, Any], layout: str | None = None) -> Any:
    """vLLM's own kv-cache planning: groups, tensors and block count of one worker."""
    from vllm.v1.core import kv_cache_planning as planning

    if layout is not None:
        config.cache_config.kv_cache_layout = layout
    with set_current_vllm_config(config):
        groups = planning.get_global_kv_cache_groups(config, [specs])
        return planning.get_kv_cache_configs(config, [specs], [1 << 40], groups)[0]


def build(model_dir: str, *, num_blocks: int, layout: str | None = None, **kw: Any) -> Engine:
    """Config, specs and kv-cache config in one call."""
    config = engine_config(model_dir, num_blocks=num_blocks, **kw)
    specs = layer_specs(config)
    kv_cache_config = plan(config, specs, layout)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as the engine core sets it
    return Engine(config, specs, kv_cache_config)


def allocate(engine: Engine, layout: str, buffer: torch.Tensor | None = None) -> dict[str, Any]:
    """vLLM's ``allocate_kv_cache`` views; with ``buffer``, the same views over that memory.

    ``buffer`` (int8, at least the allocation's size) is how tests put the allocation in POSIX
    shared memory so a sidecar process can map it: every view keeps vLLM's offset and strides.
    """
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    with set_current_vllm_config(engine.config):
        kernel = [g.kv_cache_spec.block_size for g in engine.kv_cache_config.kv_cache_groups]
        views = allocate_kv_cache(
            engine.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], kernel
        )
    if buffer is None:
        return views
    base = next(iter(views.values())).untyped_storage().data_ptr()
    flat = buffer.view(torch.int8).reshape(-1)
    out = {}
    for name, v in views.items():
        typed = flat if v.element_size() == 1 else _typed(flat, v.dtype)
        offset = (v.data_ptr() - base) // v.element_size()
        out[name] = torch.as_strided(typed, tuple(v.shape), v.stride(), offset)
    return out


def _typed(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int8 buffer seen as ``dtype`` (its length a multiple of the item size)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return flat[: flat.numel() // size * size].view(dtype)
