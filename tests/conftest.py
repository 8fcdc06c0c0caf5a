"""Shared fixtures."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from posttrain.models.tiny import make_tiny_model

sys.path.insert(0, str(Path(__file__).parent / "server"))
from serve_helpers import ServerProcess, start_server  # pyright: ignore[reportMissingImports]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 model (seed 0) with its tokenizer, built once per test session."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), arch="qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 model with its unembedding tied to the input embedding, as SmolLM2 and
    Qwen2.5-0.5B publish theirs (the test sizes untie it)."""
    return make_tiny_model(tmp_path_factory.mktemp("tied-model"), size="tiny", tied=True)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model that chats and calls a tool (tests/chat_model.py: 200 fine-tuning steps,
    about 11 s), trained once per test session."""
    from chat_model import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("chat-model") / "model")


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


class SharedRay:
    """One local Ray per test process, started by the first module that asks for it and kept
    for the modules after it: a start costs about 5 s on two cores, and some twenty modules need
    one. An idle Ray is not free either (its daemons take about 6% of a core), so once no module
    holds it for `IDLE_S`, the next test stops it. A module that must start (or watch) its own
    Ray stops it first (`without_shared_ray`)."""

    IDLE_S = 60.0  # about a start's CPU, at 6% of a core

    def __init__(self) -> None:
        self.held = False
        self.users = 0  # modules between their ray_started setup and teardown
        self.idle_since = 0.0

    def ensure(self) -> None:
        if not self.held:
            from posttrain.engine.ray.session import acquire_ray

            acquire_ray(num_cpus=4)  # 4: room for two 2-worker groups at once
            self.held = True

    def stop(self) -> None:
        if self.held:
            from posttrain.engine.ray.session import release_ray

            release_ray()
            self.held = False

    def stop_if_idle(self) -> None:
        if self.held and self.users == 0 and time.monotonic() - self.idle_since > self.IDLE_S:
            self.stop()


@pytest.fixture(scope="session")
def shared_ray() -> Iterator[SharedRay]:
    ray = SharedRay()
    yield ray
    ray.stop()


@pytest.fixture(autouse=True)
def _stop_idle_ray(shared_ray: SharedRay) -> None:
    shared_ray.stop_if_idle()


@pytest.fixture(scope="module")
def ray_started(shared_ray: SharedRay) -> Iterator[None]:
    """This process's local Ray, up for the module (and kept a while for the modules after)."""
    pytest.importorskip("ray")
    shared_ray.ensure()
    shared_ray.users += 1
    yield
    shared_ray.users -= 1
    shared_ray.idle_since = time.monotonic()


@pytest.fixture(scope="module")
def without_shared_ray(shared_ray: SharedRay) -> None:
    """No Ray session in this process when the module starts: it starts and watches its own."""
    shared_ray.stop()


@pytest.fixture(scope="session")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One `posttrain serve` process (default settings, keys KEY and OTHER_KEY) for the test
    session; a module that needs special flags defines its own `server` fixture."""
    process = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve-shared") / "storage")
    yield process
    process.stop()


@pytest.fixture(scope="session")
def shared_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, model directory) of one real vLLM server (tests/inference/vllm_server.py) for
    the test session: the qwen2 mini model (seed 0) as "base", with runtime LoRA and dev mode.
    Tests take it through `vllm_base_server`, which puts it back as it was."""
    from tests.inference.vllm_python import require_vllm
    from tests.inference.vllm_server import SHARED_ARGS, SHARED_ENV, vllm_server

    require_vllm()
    # qwen2 mini: head size 32, which vLLM's CPU attention runs; its attention and MLP layers
    # take vLLM LoRA.
    model = make_tiny_model(tmp_path_factory.mktemp("vllm-mini"), size="mini", seed=0)
    log = tmp_path_factory.mktemp("vllm-log") / "vllm-server.log"
    with vllm_server(model, log, args=SHARED_ARGS, env=SHARED_ENV) as url:
        yield url, model


@pytest.fixture
def vllm_base_server(shared_vllm_server: tuple[str, Path]) -> Iterator[tuple[str, Path]]:
    """The shared vLLM server, serving its base model alone again after the test."""
    from tests.inference.vllm_server import restore_base

    yield shared_vllm_server
    restore_base(*shared_vllm_server)


@pytest.fixture(scope="session")
def mini_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen2 mini model (seed 0): head size 32, which vLLM's CPU attention runs (the tiny
    model's 16 it does not)."""
    return make_tiny_model(tmp_path_factory.mktemp("mini-model"), size="mini", seed=0)


@pytest.fixture(scope="session")
def _vllm_engines() -> Iterator[object]:
    from tests.inference.shared_engines import SharedEngines

    engines = SharedEngines()
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def shared_vllm_engines(_vllm_engines: object) -> Iterator[object]:
    """For the module, the vLLM engines `LocalBackend` and `RayBackend` start are this test
    process's shared ones where the options match (tests/inference/shared_engines.py)."""
    from tests.inference.shared_engines import SharedEngines, shared_engines

    assert isinstance(_vllm_engines, SharedEngines)
    with shared_engines(_vllm_engines) as engines:
        yield engines
