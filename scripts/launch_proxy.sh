#!/usr/bin/env bash
# Launch the P/D proxy. Usage: scripts/launch_proxy.sh PORT PREFILL_URL DECODE_URL [proxy args...]
# e.g. scripts/launch_proxy.sh 8000 http://127.0.0.1:8100 http://127.0.0.1:8200
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
port=${1:?port}; prefill=${2:?prefill url}; decode=${3:?decode url}
shift 3
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${VENV:-$root/.venv}/bin/python" -m proxy --port "$port" --prefill "$prefill" --decode "$decode" "$@"
