"""The GPU suite: every test under tests/cuda is marked `cuda` and skips without a CUDA GPU.

`scripts/gpu-check` runs it on a GPU machine (`-m cuda`); on a CPU machine each test is
collected and skipped, so the suite stays importable and type-checked everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu-check on a GPU machine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(NO_CUDA)
