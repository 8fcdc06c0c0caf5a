"""What the real-model tests share: the packaged model's name and the skip rule for a download
that could not happen (see conftest.py)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

from posttrain.models.cache import ModelSourceError

NAME = "smollm2-135m-instruct"
REQUIRE = "POSTTRAIN_REQUIRE_REAL_MODEL"


def unreachable(exc: ModelSourceError) -> NoReturn:
    """Skip for a download that failed, unless the real model is required."""
    if os.environ.get(REQUIRE) == "1" or "could not download" not in str(exc):
        raise exc
    pytest.skip(f"the package index is unreachable: {exc}")
