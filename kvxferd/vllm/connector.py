"""KvxferdConnector: vLLM's KV connector interface over kvxferd sidecars (stub)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):
    """stub"""
