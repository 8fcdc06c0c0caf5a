"""The real-model tests: a pretrained model directory (SmolLM2-135M-Instruct: Llama
architecture, tied embeddings, a ChatML template whose end of turn `<|im_end|>` is its EOS).

They run where POSTTRAIN_REAL_MODEL_DIR names that directory and are skipped elsewhere; all are
`slow`. Each module loads what it needs once (module-scoped fixtures)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "POSTTRAIN_REAL_MODEL_DIR"


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The real model's directory, from $POSTTRAIN_REAL_MODEL_DIR; the test is skipped without."""
    value = os.environ.get(ENV)
    if not value:
        pytest.skip(f"{ENV} is not set: the real-model tests need a model directory")
    path = Path(value)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{ENV}={value} is not a model directory (no config.json)")
    return path
