"""The control-plane benchmarks' model: tiny, so a request measures the calls, not the bytes."""

from __future__ import annotations

import json
import os

TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
"""Dense, 2 layers x 1 KV head x 64 x bf16: 256 B of KV per token, 4 KiB per 16-token block and
layer; a prompt shorter than a block moves one block per layer (8 KiB)."""


def write_tiny_config(directory: str) -> str:
    """``TINY_MODEL`` as ``directory/config.json``; its path."""
    path = os.path.join(directory, "config.json")
    with open(path, "w") as fh:
        json.dump(TINY_MODEL, fh)
    return path
