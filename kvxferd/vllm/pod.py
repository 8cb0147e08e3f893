"""The connector over a prefill pod sidecar (``kvxferd serve --pod-ranks N``): what the engine's
configuration must say, the id its workers share, and how they check the sidecar's identity.

With ``"pod": true`` in ``kv_connector_extra_config`` all N TP workers of a prefill engine share
one sidecar (``sidecar_socket`` one path, without ``{rank}``): every worker registers its own
rank there, the scheduler reads that one identity and mints one ticket per request (``ranks``
N), and every worker places each hold under the scheduler's hold id with its own ``tp_rank``.
With the store on, each worker's saves and loads name its ``tp_rank`` (its own blocks, under
entries of its rank) and the scheduler's lookup names rank 0, as it asks rank 0's own sidecar.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvxferd.errors import ConfigError

DEFAULT_POD_SOCKET = "/run/kvxferd/engine.sock"


def check_config(extra: dict[str, Any], *, tp_size: int, kv_role: str) -> bool:
    """Whether the engine's workers share a pod sidecar (``"pod": true``); ConfigError for
    what a pod cannot serve: a socket per rank, TP 1, a decode-only engine (a pod sidecar only
    holds: it refuses pulls). The store is served (each rank's calls name its ``tp_rank``)."""
    pod = extra.get("pod", False)
    if pod is False:
        return False
    if pod is not True:
        raise ConfigError(f"pod: expected true or false, got {pod!r:.40}")
    for bad, why in (
        ("{rank}" in str(extra.get("sidecar_socket", "")),
         "sidecar_socket names one socket for every rank (no {rank})"),
        (tp_size < 2, f"tensor_parallel_size is {tp_size}: a pod serves 2 ranks or more"),
        (kv_role == "kv_consumer", "kv_role is kv_consumer: a pod sidecar only holds (a decode "
         "pulls through a sidecar per rank)"),
    ):  # fmt: skip
        if bad:
            raise ConfigError(f"pod: {why}")
    return True


def shared_instance(vllm_config: Any) -> str:
    """The instance id every worker of this engine registers under (a pod's identity names
    one): vLLM's per-engine ``instance_id`` and the connector's ``engine_id``, which every
    worker process gets in the same config and a restarted engine gets anew."""
    seed = f"{vllm_config.kv_transfer_config.engine_id}\0{vllm_config.instance_id}"
    return "pod-" + hashlib.sha256(seed.encode()).hexdigest()[:32]


def check_identity(ident: Any, socket: str, pod: bool, tp_size: int) -> None:
    """ConfigError unless the sidecar is what the configuration says: a pod of this engine's
    TP size with ``"pod": true``, a rank's own sidecar without."""
    if pod and ident.pod_ranks != tp_size:
        raise ConfigError(f"sidecar at {socket} serves {ident.pod_ranks} rank(s) (serve "
                          f"--pod-ranks), but \"pod\" is set and this engine has TP {tp_size}: "
                          f"start it with --pod-ranks {tp_size}")  # fmt: skip
    if not pod and ident.pod_ranks != 1:
        raise ConfigError(f"sidecar at {socket} serves a pod of {ident.pod_ranks} ranks (serve "
                          "--pod-ranks): set \"pod\": true in kv_connector_extra_config (and "
                          "one sidecar_socket for every rank), or start it without "
                          "--pod-ranks")  # fmt: skip


__all__ = ["DEFAULT_POD_SOCKET", "check_config", "check_identity", "shared_instance"]
