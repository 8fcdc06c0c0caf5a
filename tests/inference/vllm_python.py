"""Where the vLLM tests find an interpreter with vLLM: $POSTTRAIN_VLLM_PYTHON, else the repo's
.venv-vllm (scripts/setup-vllm.sh). CI sets POSTTRAIN_REQUIRE_VLLM=1, so there a missing vLLM
fails the tests instead of skipping them."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@cache
def vllm_python() -> str | None:
    candidates = [os.environ.get("POSTTRAIN_VLLM_PYTHON"), str(ROOT / ".venv-vllm/bin/python")]
    for python in filter(None, candidates):
        if Path(python).is_file():
            found = subprocess.run(
                [python, "-c", "import vllm"], capture_output=True, timeout=120, check=False
            )
            if found.returncode == 0:
                return python
    return None


def require_vllm() -> str:
    python = vllm_python()
    if python is not None:
        return python
    reason = "no interpreter with vLLM: run `bash scripts/setup-vllm.sh`"
    if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
        pytest.fail(reason)
    pytest.skip(reason)
