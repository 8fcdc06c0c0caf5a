"""One `posttrain serve` process (default settings, keys KEY and OTHER_KEY) for the test modules
of this folder that need no special flags; a module with its own `server` fixture overrides it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import ServerProcess, start_server


@pytest.fixture(scope="session")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    process = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve-shared") / "storage")
    yield process
    process.stop()
