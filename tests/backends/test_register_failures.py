"""A registration that fails leaves the model and the run as they were, on every backend.

The same scenarios run against LocalBackend, RayBackend (a local Ray) and TinkerBackend
(against a real `posttrain serve`):
- a base model that does not exist: refused before anything loads or the service makes a model,
  with an error naming the path; the corrected path then registers under the same name;
- a failure after the client (or the service's model) exists, while resuming a checkpoint: a
  metric sink that refuses to open, or model.json that cannot be written. The model is not
  attached, its step and run_state are untouched, no sink stays open, the service's model is
  freed, and registering again resumes the checkpoint cleanly.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.protocol import TrainableBackend
from posttrain.model import TrainableModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_helpers import (  # pyright: ignore[reportMissingImports]
    KEY,
    ServerProcess,
    post,
    result,
    start_server,
)

MakeBackend = Callable[[Path], TrainableBackend]
BACKENDS = [
    "local",
    pytest.param("ray", marks=pytest.mark.slow),  # Ray and its actors start in seconds
    pytest.param("tinker", marks=pytest.mark.slow),  # so does the server subprocess
]


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    process = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve-register") / "storage")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def ray_started() -> Iterator[None]:
    pytest.importorskip("ray")
    from posttrain.engine.ray_session import ray_session

    with ray_session(num_cpus=2):
        yield


@pytest.fixture(params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_backend(kind: str, request: pytest.FixtureRequest) -> MakeBackend:
    if kind == "local":
        return lambda path: LocalBackend(path)
    if kind == "ray":
        request.getfixturevalue("ray_started")
        from posttrain.backends.ray import RayBackend
        from posttrain.engine.ray_executor import RayConfig

        config = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)
        return lambda path: RayBackend(path, num_workers=1, ray_config=config)
    pytest.importorskip("tinker")
    from posttrain.backends.tinker import TinkerBackend

    process: ServerProcess = request.getfixturevalue("server")
    return lambda path: TinkerBackend(path, base_url=process.url, api_key=KEY)


def training_runs(kind: str, request: pytest.FixtureRequest) -> set[str]:
    """The server's models of this key (none for the in-process backends)."""
    if kind != "tinker":
        return set()
    process: ServerProcess = request.getfixturevalue("server")
    response = httpx.get(
        f"{process.url}/api/v1/training_runs", params={"limit": 1000}, headers={"X-API-Key": KEY}
    )
    return {r["training_run_id"] for r in response.json()["training_runs"]}


def is_loaded(process: ServerProcess, model_id: str) -> bool:
    """Whether the server still holds the model: a request of a freed one fails at once with
    "not loaded" (a held one would wait for the seq_ids before this one, then fail)."""
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    body = {"model_id": model_id, "seq_id": 10**6, "adam_params": adam}
    submitted = post(process, "optim_step", json=body)
    assert submitted.status_code == 200, submitted.text
    return "not loaded" not in result(process, submitted.json()["request_id"]).get("error", "")


def tensorboard_writers() -> int:
    """Open TensorBoard writers: each runs a writer thread until it is closed."""
    return sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate())


def tiny(name: str, base_model: Path | str, **kwargs: object) -> TrainableModel:
    return TrainableModel(name=name, project="p", base_model=str(base_model), lora_rank=4, **kwargs)  # type: ignore[arg-type]


def assert_not_registered(backend: TrainableBackend, model: TrainableModel) -> None:
    with pytest.raises(RuntimeError, match="not registered"):
        model.directory  # noqa: B018 - not attached
    with pytest.raises(RuntimeError, match="not registered"):
        backend.client(model)  # type: ignore[attr-defined]


async def test_a_missing_base_model_is_refused_before_any_work(
    kind: str, make_backend: MakeBackend, request: pytest.FixtureRequest, tiny_model_dir, tmp_path
):
    backend = make_backend(tmp_path / "runs")
    runs = training_runs(kind, request)
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as caught:
        await tiny("x", missing).register(backend)
    message = str(caught.value)
    # It names the model, the path, and the two ways to fix it.
    assert "cannot register model 'x'" in message and str(missing) in message
    assert "make-tiny-model" in message and "hub id" in message
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        await tiny("x", not_a_model).register(backend)
    run_dir = tmp_path / "runs" / "p" / "models" / "x"
    assert not (run_dir / "model.json").exists()
    assert training_runs(kind, request) == runs  # the service made no model
    # The corrected path registers under the same name (a wrong first attempt does not block it).
    fixed = tiny("x", tiny_model_dir)
    await fixed.register(backend)
    assert json.loads((run_dir / "model.json").read_text())["base_model"] == str(tiny_model_dir)
    await backend.close()


def unreachable_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow as installed but with its tracking server unreachable: its sink fails as it opens
    (after the TensorBoard sink opened)."""
    mlflow = types.ModuleType("mlflow")

    def unreachable(name: str) -> None:
        raise ConnectionError(f"mlflow tracking server unreachable (experiment {name!r})")

    mlflow.set_experiment = unreachable  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)


@pytest.mark.parametrize("failure", ["sink", "model.json"])
async def test_a_register_that_fails_late_leaves_the_model_as_it_was(
    kind: str,
    make_backend: MakeBackend,
    request: pytest.FixtureRequest,
    tiny_model_dir,
    tmp_path,
    monkeypatch,
    failure: str,
):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (optional)")
    backend = make_backend(tmp_path)
    saved = tiny("m", tiny_model_dir, report_metrics=[])
    await saved.register(backend)
    saved.run_state["cursor"] = 7
    saved.set_step(2)  # as if two steps were trained
    await backend.checkpoint(saved)  # type: ignore[attr-defined]  # one to resume, with run_state
    model_json = saved.directory / "model.json"
    await backend.close()

    if failure == "sink":
        unreachable_mlflow(monkeypatch)
        error: type[Exception] = ConnectionError
        match, sinks = "tracking server unreachable", ["tensorboard", "mlflow"]
    else:  # a dangling symlink: reads as absent, and writing through it fails
        model_json.unlink()
        model_json.symlink_to(tmp_path / "gone" / "model.json")
        error, match, sinks = FileNotFoundError, "model.json", ["tensorboard"]
    writers, runs = tensorboard_writers(), training_runs(kind, request)
    backend = make_backend(tmp_path)
    model = tiny("m", tiny_model_dir, report_metrics=sinks)
    with pytest.raises(error, match=match):
        await model.register(backend)
    assert tensorboard_writers() == writers  # the TensorBoard sink was closed again
    assert_not_registered(backend, model)
    assert model.step == 0 and model.run_state == {}  # the checkpoint's state is not half-loaded
    if kind == "tinker":  # the model the service made for this registration is freed again
        [made] = training_runs(kind, request) - runs
        assert not is_loaded(request.getfixturevalue("server"), made)

    # Without the failure, the same backend resumes the checkpoint.
    model_json.unlink(missing_ok=True)
    model.report_metrics = ["tensorboard"]
    await model.register(backend)
    assert (model.step, model.run_state) == (2, {"cursor": 7})
    assert tensorboard_writers() == writers + 1
    await backend.close()
