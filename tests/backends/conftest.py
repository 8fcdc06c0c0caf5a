"""Fixtures for the tests that run one scenario against every backend (see backend_kinds.py)."""

from __future__ import annotations

import pytest
from backend_kinds import KINDS, MakeBackend, make
from serve_helpers import ServerProcess  # pyright: ignore[reportMissingImports]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server_of(kind: str, request: pytest.FixtureRequest) -> ServerProcess | None:
    """The `posttrain serve` a TinkerBackend of this kind trains on (None for the others)."""
    if kind != "tinker":
        return None
    pytest.importorskip("tinker")
    return request.getfixturevalue("server")


@pytest.fixture
def make_backend(
    kind: str, server_of: ServerProcess | None, request: pytest.FixtureRequest
) -> MakeBackend:
    if kind == "ray":
        request.getfixturevalue("ray_started")
    return lambda path: make(kind, path, server_of)
