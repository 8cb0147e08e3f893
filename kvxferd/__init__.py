"""kvxferd: a KV-cache transfer daemon for disaggregated prefill/decode LLM serving."""

__version__ = "0.1.0"
