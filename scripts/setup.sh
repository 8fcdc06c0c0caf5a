#!/usr/bin/env bash
# Creates .venv (when missing) and installs posttrain with its dev tools, at the versions in
# constraints.txt (scripts/lock.sh writes it; CONSTRAINTS=none resolves afresh instead).
# torch comes from scripts/install-torch.sh: the CPU wheel index where no CUDA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
CONSTRAINTS=${CONSTRAINTS:-constraints.txt}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python

bash scripts/install-torch.sh "$VPY"

PINS=()
if [ "$CONSTRAINTS" != none ]; then
  PINS=(-c "$CONSTRAINTS")
fi
echo "[setup] installing posttrain[${EXTRAS:-dev}] (constraints: $CONSTRAINTS)"
"$VPY" -m pip install -q -e ".[${EXTRAS:-dev}]" "${PINS[@]}"
echo "[setup] done: $("$VPY" -c 'import torch, posttrain; print("torch", torch.__version__, "| posttrain", posttrain.__version__)')"
