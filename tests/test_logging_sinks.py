"""model.log's optional sinks: chosen by `report_metrics` (or POSTTRAIN_LOG_TO), never required.

None of tensorboard, wandb and mlflow is a posttrain dependency. For a sink whose package is not
installed here the missing-package error is tested for real; for one that is, its absence is
simulated the way Python itself marks a module unimportable (None in sys.modules).
"""

from __future__ import annotations

import sys
import threading
import types

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.logging_sinks import SINK_NAMES, SINK_PACKAGES, is_installed


def test_unknown_sink_names_the_setting_and_the_choices():
    with pytest.raises(ValueError, match=r"report_metrics: unknown sink 'tensorbord'.*tensorboard"):
        TrainableModel(name="m", project="p", base_model="x", report_metrics=["tensorbord"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"a list of sink names, e\.g\. \['wandb'\]"):
        TrainableModel(name="m", project="p", base_model="x", report_metrics="wandb")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("sink", SINK_NAMES)
def test_a_sink_whose_package_is_missing_names_the_package(sink, monkeypatch):
    package = SINK_PACKAGES[sink]
    if is_installed(package):
        monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(
        ImportError,
        match=rf"asks for {sink}, whose package '{package}' is not installed: pip install {package}",
    ):
        TrainableModel(name="m", project="p", base_model="x", report_metrics=[sink], lora_rank=8)


async def test_the_environment_variable_is_checked_at_register(
    tiny_model_dir, tmp_path, monkeypatch
):
    backend = LocalBackend(tmp_path)
    monkeypatch.setenv("POSTTRAIN_LOG_TO", "tensorboard, nope")
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=8)
    with pytest.raises(ValueError, match="POSTTRAIN_LOG_TO: unknown sink 'nope'"):
        await model.register(backend)
    assert not (tmp_path / "p" / "models" / "m" / "model.json").exists()  # nothing registered
    with pytest.raises(RuntimeError, match="not registered"):
        backend.client(model)
    # An explicit list wins over the environment: [] means no sink at all.
    quiet = TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), report_metrics=[], lora_rank=8
    )
    await quiet.register(backend)
    assert await quiet.log(metrics={"loss": 1.5}) == {"loss": 1.5}
    assert quiet.history() == [{"step": 0, "split": "train", "loss": 1.5}]
    await backend.close()


async def test_tensorboard_sink_writes_the_logged_scalars(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (optional)")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    backend = LocalBackend(tmp_path)
    model = TrainableModel(
        name="m",
        project="p",
        base_model=str(tiny_model_dir),
        report_metrics=["tensorboard"],
        lora_rank=8,
    )
    await model.register(backend)
    await model.log(metrics={"loss": 0.25}, step=3)
    events = EventAccumulator(str(model.directory / "tensorboard"))
    events.Reload()
    (scalar,) = events.Scalars("train/loss")
    assert (scalar.step, scalar.value) == (3, 0.25)
    await backend.close()


def _tensorboard_writers() -> int:
    """Open TensorBoard writers: each runs a writer thread until it is closed."""
    return sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate())


async def test_a_sink_that_fails_to_open_leaves_the_model_as_it_was(
    tiny_model_dir, tmp_path, monkeypatch
):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (optional)")
    backend = LocalBackend(tmp_path)
    saved = TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), report_metrics=[], lora_rank=8
    )
    await saved.register(backend)
    saved.run_state["cursor"] = 7
    saved.set_step(2)  # as if two steps were trained
    await backend.checkpoint(saved)  # a checkpoint to resume, with its run_state
    await backend.close()
    # MLflow as installed but with its tracking server unreachable: it fails as its sink opens,
    # after the TensorBoard sink opened.
    mlflow = types.ModuleType("mlflow")

    def unreachable(name: str) -> None:
        raise ConnectionError(f"mlflow tracking server unreachable (experiment {name!r})")

    mlflow.set_experiment = unreachable  # pyright: ignore[reportAttributeAccessIssue]
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    writers = _tensorboard_writers()
    backend = LocalBackend(tmp_path)
    model = TrainableModel(
        name="m",
        project="p",
        base_model=str(tiny_model_dir),
        report_metrics=["tensorboard", "mlflow"],
        lora_rank=8,
    )
    with pytest.raises(ConnectionError, match="tracking server unreachable"):
        await model.register(backend)
    assert _tensorboard_writers() == writers  # the TensorBoard sink was closed again
    with pytest.raises(RuntimeError, match="not registered"):
        model.directory  # noqa: B018 - not attached
    assert model.step == 0 and model.run_state == {}  # the checkpoint's state is not half-loaded
    # Registered again without the failing sink, it resumes the checkpoint.
    model.report_metrics = ["tensorboard"]
    await model.register(backend)
    assert (model.step, model.run_state) == (2, {"cursor": 7})
    assert _tensorboard_writers() == writers + 1
    await backend.close()
