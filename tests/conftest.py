"""Shared fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.engine.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 model (seed 0) with its tokenizer, built once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), arch="qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 model with its unembedding tied to the input embedding, as SmolLM2 and
    Qwen2.5-0.5B publish theirs (the test sizes untie it)."""
    return make_tiny_model(tmp_path_factory.mktemp("tied-model"), size="tiny", tied=True)


@pytest.fixture
def posttrain_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$POSTTRAIN_CACHE (converted GGUF files, packaged models) in this test's own folder, never
    the user's cache."""
    root = tmp_path / "posttrain-cache"
    monkeypatch.setenv("POSTTRAIN_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny llama model, seed 3, written as an F32 GGUF file; the directory it came from),
    built once per test session (tests/gguf_files.py)."""
    from gguf_files import write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path, seed=3)


@pytest.fixture
def standin() -> Iterator[object]:
    """The stand-in judge server of recipes/judge_standin.py on a free loopback port, in a
    thread (its `requests`, `fail_first` and `delay_s` are the test's to read and set)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    from judge_standin import StandinJudge  # pyright: ignore[reportMissingImports]

    server = StandinJudge().start()
    yield server
    server.shutdown()
    server.server_close()
