#!/usr/bin/env bash
# Launch one vLLM instance on CPU: ROLE is prefill, decode or colocated.
# Usage: scripts/launch_vllm.sh ROLE PORT [extra vllm args...]
# Env:   MODEL_DIR, VENV, KV_CONFIG (json file; default configs/kv-{ROLE}-cpu.json),
#        CPU_CORE (OMP bind, default 0 for prefill/colocated, 1 for decode),
#        KV_CACHE_BYTES (default 256 MiB), BLOCK_SIZE (default 32), MAX_MODEL_LEN (default 1024)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
role=${1:?role: prefill|decode|colocated}
port=${2:?port}
shift 2
VENV=${VENV:-$root/.venv}
MODEL_DIR=${MODEL_DIR:-$root/models/tiny-llama}
case "$role" in
  prefill) core=${CPU_CORE:-0}; kv=${KV_CONFIG:-$root/configs/kv-prefill-cpu.json} ;;
  decode) core=${CPU_CORE:-1}; kv=${KV_CONFIG:-$root/configs/kv-decode-cpu.json} ;;
  colocated) core=${CPU_CORE:-0}; kv="" ;;
  *) echo "unknown role $role" >&2; exit 2 ;;
esac
kv_args=()
[ -n "$kv" ] && kv_args=(--kv-transfer-config "$(cat "$kv")")
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-$core}
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name "${SERVED_MODEL_NAME:-tiny-llama}" \
  --host "${HOST:-127.0.0.1}" --port "$port" \
  --dtype bfloat16 --enforce-eager --seed 0 \
  --max-model-len "${MAX_MODEL_LEN:-1024}" --max-num-seqs "${MAX_NUM_SEQS:-16}" \
  --block-size "${BLOCK_SIZE:-32}" --kv-cache-memory-bytes "${KV_CACHE_BYTES:-268435456}" \
  "${kv_args[@]}" "$@"
