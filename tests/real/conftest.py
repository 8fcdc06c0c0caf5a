"""The real-model tests: SmolLM2-135M-Instruct (Llama architecture, tied embeddings, a ChatML
template whose end of turn `<|im_end|>` is its EOS), fetched from the package index as a user
would (`posttrain fetch-model`, cached in $POSTTRAIN_CACHE, else ~/.cache/posttrain).

All are `slow`. Without the package index they are skipped, unless POSTTRAIN_REQUIRE_REAL_MODEL=1
(CI sets it: there a failed download fails). POSTTRAIN_REAL_MODEL_DIR names a model directory
to use instead of fetching. Each module loads what it needs once (module-scoped fixtures)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from real_model import NAME, unreachable

from posttrain.models.cache import ModelSourceError
from posttrain.models.packaged import fetch_model

ENV = "POSTTRAIN_REAL_MODEL_DIR"


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The real model's directory: $POSTTRAIN_REAL_MODEL_DIR, else the packaged model."""
    value = os.environ.get(ENV)
    if value:
        path = Path(value)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{ENV}={value} is not a model directory (no config.json)")
        return path
    try:
        return fetch_model(NAME)
    except ModelSourceError as exc:
        unreachable(exc)
