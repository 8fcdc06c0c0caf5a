#!/usr/bin/env bash
# Creates .venv (when missing) and installs posttrain with its dev tools, at the versions in
# constraints.txt (scripts/lock.sh writes it; CONSTRAINTS=none resolves afresh instead).
# Where no CUDA GPU is present, torch comes from the CPU wheel index (a plain `pip install torch`
# would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
VENV=${VENV:-.venv}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python

if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  elif "$VPY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=5)" \
      2>/dev/null; then
    echo "[setup] no CUDA GPU: installing torch==$TORCH_VERSION (CPU build)"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION" \
      --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
  else
    # Asking an unreachable index costs pip minutes of retries for each of torch's packages.
    echo "[setup] no CUDA GPU, and $CPU_INDEX does not answer: installing torch==$TORCH_VERSION"
    echo "[setup] from the configured index (PyPI's Linux wheel is a CUDA build; a local CPU"
    echo "[setup] wheel in PIP_FIND_LINKS is taken instead where there is one)"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  fi
fi

PINS=()
if [ "$CONSTRAINTS" != none ]; then
  PINS=(-c "$CONSTRAINTS")
fi
echo "[setup] installing posttrain[${EXTRAS:-dev}] (constraints: $CONSTRAINTS)"
"$VPY" -m pip install -q -e ".[${EXTRAS:-dev}]" "${PINS[@]}"
echo "[setup] done: $("$VPY" -c 'import torch, posttrain; print("torch", torch.__version__, "| posttrain", posttrain.__version__)')"
