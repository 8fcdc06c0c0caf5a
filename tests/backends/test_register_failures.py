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

import pytest
from backend_kinds import MakeBackend, is_loaded, tiny, training_runs
from serve_helpers import ServerProcess  # pyright: ignore[reportMissingImports]

from posttrain.backends.model import TrainableModel
from posttrain.backends.protocol import TrainableBackend


def tensorboard_writers() -> int:
    """Open TensorBoard writers: each runs a writer thread until it is closed."""
    return sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate())


def assert_not_registered(backend: TrainableBackend, model: TrainableModel) -> None:
    with pytest.raises(RuntimeError, match="not registered"):
        model.directory  # noqa: B018 - not attached
    with pytest.raises(RuntimeError, match="not registered"):
        backend.client(model)  # pyright: ignore[reportAttributeAccessIssue]


async def test_a_missing_base_model_is_refused_before_any_work(
    make_backend: MakeBackend, server_of: ServerProcess | None, tiny_model_dir, tmp_path
):
    backend = make_backend(tmp_path / "runs")
    runs = training_runs(server_of)
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
    assert training_runs(server_of) == runs  # the service made no model
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

    mlflow.set_experiment = unreachable  # pyright: ignore[reportAttributeAccessIssue]
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)


@pytest.mark.parametrize("failure", ["sink", "model.json"])
async def test_a_register_that_fails_late_leaves_the_model_as_it_was(
    make_backend: MakeBackend,
    server_of: ServerProcess | None,
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
    await backend.checkpoint(saved)  # pyright: ignore[reportAttributeAccessIssue]  # one to resume, with run_state
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
    writers, runs = tensorboard_writers(), training_runs(server_of)
    backend = make_backend(tmp_path)
    model = tiny("m", tiny_model_dir, report_metrics=sinks)
    with pytest.raises(error, match=match):
        await model.register(backend)
    assert tensorboard_writers() == writers  # the TensorBoard sink was closed again
    assert_not_registered(backend, model)
    assert model.step == 0 and model.run_state == {}  # the checkpoint's state is not half-loaded
    if server_of is not None:  # the model the service made for this registration is freed again
        [made] = training_runs(server_of) - runs
        assert not is_loaded(server_of, made)

    # Without the failure, the same backend resumes the checkpoint.
    model_json.unlink(missing_ok=True)
    model.report_metrics = ["tensorboard"]
    await model.register(backend)
    assert (model.step, model.run_state) == (2, {"cursor": 7})
    assert tensorboard_writers() == writers + 1
    await backend.close()
