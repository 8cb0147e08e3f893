#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.33.0 (CPU-usable parts) beside kvxferd, for tests/vllm and
# scripts/vllm_pd_check.py. Idempotent: a stamp file records what was installed.
# vLLM's wheel is a CUDA build; we install it --no-deps over the CPU torch and add only the
# pure-Python dependencies its scheduler, config, KV allocation and worker glue import.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.installed-stamp"
KEY="vllm==0.33.0 torch==2.13.0 $(sha256sum scripts/vllm-venv.sh pyproject.toml | sha256sum | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  exit 0
fi
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps vllm==0.33.0 xgrammar==0.2.8
"${PIP[@]}" \
  'transformers<5.21' tokenizers msgspec pydantic pyzmq cloudpickle cachetools psutil blake3 \
  regex cbor2 aiohttp requests openai openai-harmony pillow pybase64 uvloop py-cpuinfo \
  prometheus_client 'fastapi<0.137' partial-json-parser 'llguidance<1.8' einops \
  'apache-tvm-ffi==0.1.11' sentencepiece gguf compressed-tensors==0.17.0 \
  nixl==1.5.1 httpx uvicorn numpy pytest pytest-timeout
"${PIP[@]}" --no-deps -e .
echo "$KEY" > "$STAMP"
