"""The toy P/D proxy: an OpenAI-compatible front that sends each request to a prefill (1 token,
``kv_transfer_params`` stub), then the original request with the returned params to a decode.

It speaks vLLM's toy-proxy protocol, so it fronts ``kvxferd sim`` and real vLLM servers alike.
"""

from kvxferd.proxy.app import ProxySettings, proxy_app
from kvxferd.proxy.routing import Backend, RoundRobin, normalize_url
from kvxferd.proxy.server import serve_proxy

__all__ = ["Backend", "ProxySettings", "RoundRobin", "normalize_url", "proxy_app", "serve_proxy"]
