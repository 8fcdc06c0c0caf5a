"""Every `doctor` here asks a vLLM interpreter that does not exist, answered at once, so no
test waits ~5-10 s for the real `import vllm` (test_doctor.py points it elsewhere to test it)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_vllm_python(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
