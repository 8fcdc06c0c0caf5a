#!/usr/bin/env bash
# Installs torch==$TORCH_VERSION into the venv whose python is $1, unless it has torch: the CUDA
# build where a CUDA GPU is present, else the CPU build from the CPU wheel index (a plain
# `pip install torch` would pull a multi-GB CUDA build). Arguments after $1 go to pip.
# scripts/setup.sh and scripts/release-check call it.
set -euo pipefail
VPY=$1
shift
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu

if "$VPY" -c "import torch" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" "$@"
elif "$VPY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=5)" \
    2>/dev/null; then
  echo "[setup] no CUDA GPU: installing torch==$TORCH_VERSION (CPU build)"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" \
    --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple "$@"
else
  # Asking an unreachable index costs pip minutes of retries for each of torch's packages.
  echo "[setup] no CUDA GPU, and $CPU_INDEX does not answer: installing torch==$TORCH_VERSION"
  echo "[setup] from the configured index (PyPI's Linux wheel is a CUDA build; a local CPU"
  echo "[setup] wheel in PIP_FIND_LINKS is taken instead where there is one)"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" "$@"
fi
