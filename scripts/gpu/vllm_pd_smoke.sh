#!/usr/bin/env bash
# vLLM P/D on one GPU with KvxferdConnector: two `vllm serve --load-format dummy` engines
# (prefill, decode), one `kvxferd serve` each (CUDA IPC of vLLM's KV allocation), `kvxferd proxy`
# in front, the `openai` client; the answers must equal a colocated engine's (greedy, same dummy
# weights via a fixed seed). UNTESTED: no GPU was lent when it was written.
# Usage: scripts/gpu/vllm_pd_smoke.sh [MODEL]   (needs vllm==0.33.0 and kvxferd installed)
set -euo pipefail
MODEL=${1:-Qwen/Qwen3-0.6B}
WORK=$(mktemp -d)
export KVXFERD_PEER_TOKEN=${KVXFERD_PEER_TOKEN:-smoke-$(date +%s)}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-all}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

KVCFG='{"kv_connector":"KvxferdConnector","kv_connector_module_path":"kvxferd.vllm","kv_role":"kv_both","kv_connector_extra_config":{"sidecar_socket":"SOCK"}}'
COMMON=(--load-format dummy --seed 0 --gpu-memory-utilization 0.25 --max-model-len 2048 --enforce-eager)

kvxferd serve --engine-socket "$WORK/p.sock" --peer-port 7601 --engine-id prefill & PIDS+=($!)
kvxferd serve --engine-socket "$WORK/d.sock" --peer-port 7602 --engine-id decode & PIDS+=($!)
vllm serve "$MODEL" --port 8101 "${COMMON[@]}" --kv-transfer-config "${KVCFG/SOCK/$WORK/p.sock}" & PIDS+=($!)
vllm serve "$MODEL" --port 8102 "${COMMON[@]}" --kv-transfer-config "${KVCFG/SOCK/$WORK/d.sock}" & PIDS+=($!)
vllm serve "$MODEL" --port 8103 "${COMMON[@]}" & PIDS+=($!)   # colocated reference
kvxferd proxy --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102 --port 8100 & PIDS+=($!)

for port in 8101 8102 8103; do
  for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 2; done
done

python3 - "$MODEL" <<'PY'
import sys
from openai import OpenAI

model = sys.argv[1]
pd = OpenAI(base_url="http://127.0.0.1:8100/v1", api_key="x")
ref = OpenAI(base_url="http://127.0.0.1:8103/v1", api_key="x")
prompts = [f"Request {i}: " + "tell me a story about KV caches " * (20 + i) for i in range(8)]
bad = 0
for p in prompts:
    a = pd.completions.create(model=model, prompt=p, max_tokens=32, temperature=0).choices[0].text
    b = ref.completions.create(model=model, prompt=p, max_tokens=32, temperature=0).choices[0].text
    bad += a != b
print(f"{len(prompts) - bad} passed, {bad} failed")
sys.exit(1 if bad else 0)
PY
