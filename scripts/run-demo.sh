#!/usr/bin/env bash
# Command 1 of 2: set up (idempotent) and run the 1P1D demo on this machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec "${VENV:-$root/.venv}/bin/python" -m scripts.demo "$@"
