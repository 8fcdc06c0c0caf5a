"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.engine.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 model (seed 0) with its tokenizer, built once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), arch="qwen2", size="tiny", seed=0)
