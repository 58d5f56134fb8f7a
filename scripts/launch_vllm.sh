#!/usr/bin/env bash
# Launch one vLLM instance with our connector. ROLE is prefill, decode or colocated.
# Usage: scripts/launch_vllm.sh ROLE PORT [extra vllm args...]
# Env:   PD_DEVICE        cpu (default: the CPU lab) or gpu (defaults left to vLLM)
#        MODEL_DIR        model path (default models/tiny-llama)
#        SERVED_MODEL_NAME (default tiny-llama)     HOST (bind address, default 127.0.0.1)
#        KV_CONFIG        kv-transfer config file (default configs/kv-ROLE-PD_DEVICE.json)
#        VLLM_EXTRA_ARGS  more vLLM arguments, split on spaces
#        PYTHON           interpreter (default: VENV/bin/python if present, else python3)
#   CPU only: CPU_CORE (OMP binding; prefill/colocated 0, decode 1), KV_CACHE_BYTES
#        (256 MiB), BLOCK_SIZE (32, a multiple of 32 on CPU), MAX_MODEL_LEN (1024), MAX_NUM_SEQS (16)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
role=${1:?role: prefill|decode|colocated}
port=${2:?port}
shift 2
device=${PD_DEVICE:-cpu}
VENV=${VENV:-$root/.venv}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$VENV/bin/python" ]; then PYTHON=$VENV/bin/python; else PYTHON=python3; fi
fi
case "$role" in
  prefill) core=${CPU_CORE:-0}; kv=${KV_CONFIG:-$root/configs/kv-prefill-$device.json} ;;
  decode) core=${CPU_CORE:-1}; kv=${KV_CONFIG:-$root/configs/kv-decode-$device.json} ;;
  colocated) core=${CPU_CORE:-0}; kv="" ;;
  *) echo "unknown role $role (prefill|decode|colocated)" >&2; exit 2 ;;
esac
args=(--model "${MODEL_DIR:-$root/models/tiny-llama}" --served-model-name "${SERVED_MODEL_NAME:-tiny-llama}"
      --host "${HOST:-127.0.0.1}" --port "$port" --seed 0)
[ -n "$kv" ] && args+=(--kv-transfer-config "$(cat "$kv")")
if [ "$device" = cpu ]; then
  # The CPU lab: Mooncake over TCP on loopback unless the environment says otherwise (the
  # config files pin nothing, so PD_KV_* always applies, e.g. in the compose lab).
  export PD_KV_PROTOCOL=${PD_KV_PROTOCOL:-tcp} PD_KV_HOST=${PD_KV_HOST:-127.0.0.1}
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-$core}
  args+=(--dtype bfloat16 --enforce-eager --max-model-len "${MAX_MODEL_LEN:-1024}"
         --max-num-seqs "${MAX_NUM_SEQS:-16}" --block-size "${BLOCK_SIZE:-32}"
         --kv-cache-memory-bytes "${KV_CACHE_BYTES:-268435456}")
fi
read -r -a extra <<< "${VLLM_EXTRA_ARGS:-}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec "$PYTHON" -m vllm.entrypoints.openai.api_server "${args[@]}" "${extra[@]}" "$@"
