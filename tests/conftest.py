"""Shared fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
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
def wrong_modes() -> Iterator[Callable[[Path], dict[str, str]]]:
    """Sets the umask to 027 for the test, and gives what under a directory (itself included)
    has another mode than that umask gives (files 0640, directories 0750): a mode that follows
    the umask is told apart from a fixed 0644 or 0755 and from safetensors' and mkdtemp's own
    0600 and 0700."""

    def check(directory: Path) -> dict[str, str]:
        paths = [directory, *directory.rglob("*")]
        modes = {
            str(p.relative_to(directory)): (p.stat().st_mode & 0o777, p.is_dir()) for p in paths
        }
        return {
            name: oct(mode)
            for name, (mode, is_dir) in modes.items()
            if mode != (0o750 if is_dir else 0o640)
        }

    old = os.umask(0o027)
    try:
        yield check
    finally:
        os.umask(old)


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
