"""kvxferd inside vLLM: the KV connector vLLM loads by ``kv_connector_module_path: kvxferd.vllm``.

Only this package imports vllm (an optional extra, ``kvxferd[vllm]``).
"""

from kvxferd.vllm.connector import KvxferdConnector

__all__ = ["KvxferdConnector"]
