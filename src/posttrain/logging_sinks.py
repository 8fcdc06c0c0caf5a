"""Optional metric sinks beside history.jsonl: TensorBoard, Weights & Biases, MLflow.

None is required. A model sends `model.log` rows to the sinks named by
`TrainableModel(report_metrics=[...])`; with `report_metrics=None` (the default), to those named
by the `POSTTRAIN_LOG_TO` environment variable (comma-separated), if set. Asking for a sink
whose package is not installed is an error naming the package. W&B and MLflow read their own
configuration (API key, tracking URI) from their usual environment variables.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal, Protocol, get_args

SinkName = Literal["tensorboard", "wandb", "mlflow"]
SINK_NAMES: tuple[SinkName, ...] = get_args(SinkName)
# The package each sink needs (TensorBoard's writer is torch's, but it imports tensorboard).
SINK_PACKAGES: dict[SinkName, str] = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
ENV_VAR = "POSTTRAIN_LOG_TO"


class Sink(Protocol):
    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars `<split>/<metric>` under `<model dir>/tensorboard`."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory / "tensorboard"))

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"{split}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, name: str) -> None:
        import wandb  # pyright: ignore[reportMissingImports]

        self._run = wandb.init(project=project, name=name, resume="allow")

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowSink:
    def __init__(self, project: str, name: str) -> None:
        import mlflow  # pyright: ignore[reportMissingImports]

        mlflow.set_experiment(project)
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=name)

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics({f"{split}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def is_installed(package: str) -> bool:
    # A None entry in sys.modules is Python's own way of marking a module unimportable.
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def check_sinks(names: Iterable[str], source: str) -> tuple[SinkName, ...]:
    """The sink names, checked: each known and its package installed. `source` names the
    setting they came from, for the error."""
    given = list(names)
    for name in given:  # every name first: a typo is reported before a missing package
        if name not in SINK_NAMES:
            raise ValueError(f"{source}: unknown sink {name!r}; use {', '.join(SINK_NAMES)}")
    checked: list[SinkName] = [name for name in given if name in SINK_NAMES]  # all of them
    for sink in checked:
        package = SINK_PACKAGES[sink]
        if not is_installed(package):
            raise ImportError(
                f"{source} asks for {sink}, whose package {package!r} is not installed: "
                f"pip install {package}"
            )
    return tuple(checked)


def sinks_from_env(env: Mapping[str, str]) -> tuple[SinkName, ...]:
    """The sinks `POSTTRAIN_LOG_TO` names in `env` (none when it is unset or empty)."""
    value = env.get(ENV_VAR, "")  # unset: no sinks
    return check_sinks([n.strip() for n in value.split(",") if n.strip()], ENV_VAR)


def open_sinks(
    names: Iterable[SinkName], directory: Path, *, project: str, name: str
) -> list[Sink]:
    """One sink per name (already checked by `check_sinks`); if one fails to open, those
    opened before it are closed again."""
    sinks: list[Sink] = []
    try:
        for sink in names:
            if sink == "tensorboard":
                sinks.append(TensorBoardSink(directory))
            elif sink == "wandb":
                sinks.append(WandbSink(project, name))
            else:
                sinks.append(MLflowSink(project, name))
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: Iterable[Sink]) -> None:
    """Close each sink, all of them even if one fails (the first failure is raised after)."""
    failure: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
