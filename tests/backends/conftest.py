"""Fixtures for the tests that run one scenario against every backend (see backend_kinds.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from backend_kinds import KINDS, MakeBackend, make
from serve_helpers import ServerProcess, start_server  # pyright: ignore[reportMissingImports]


# Per module, not per session: a server left running would be a child process of the test
# session that tests/clients/test_ray_lifecycle.py counts as Ray's, waiting for it to exit.
@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    process = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve") / "storage")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def ray_started() -> Iterator[None]:
    pytest.importorskip("ray")
    from posttrain.engine.ray.session import ray_session

    with ray_session(num_cpus=2):
        yield


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
