"""Optional metric sinks beside history.jsonl: TensorBoard, Weights & Biases, MLflow.

None is required. A sink is used when its package is installed and it is asked for with
`POSTTRAIN_LOG_TO` (comma-separated: `tensorboard`, `wandb`, `mlflow`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

SINK_NAMES = ("tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Sink(Protocol):
    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None: ...


class TensorBoardSink:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(directory / "tensorboard"))

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"{split}/{key}", value, step)
        self._writer.flush()


class WandbSink:
    def __init__(self, project: str, name: str) -> None:
        import wandb  # pyright: ignore[reportMissingImports]

        self._run = wandb.init(project=project, name=name, resume="allow")

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step)


class MLflowSink:
    def __init__(self, project: str, name: str) -> None:
        import mlflow  # pyright: ignore[reportMissingImports]

        mlflow.set_experiment(project)
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_name=name)

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics({f"{split}/{k}": v for k, v in metrics.items()}, step=step)


def requested_sinks(env: Mapping[str, str] | None = None) -> list[str]:
    value = (env if env is not None else os.environ).get("POSTTRAIN_LOG_TO", "")
    names = [n.strip() for n in value.split(",") if n.strip()]
    for name in names:
        if name not in SINK_NAMES:
            raise ValueError(
                f"POSTTRAIN_LOG_TO names unknown sink {name!r}; use {', '.join(SINK_NAMES)}"
            )
    return names


def default_sinks(directory: Path, *, project: str, name: str) -> list[Sink]:
    """The requested sinks whose packages are installed (a missing one is an error)."""
    sinks: list[Sink] = []
    for sink in requested_sinks():
        if importlib.util.find_spec(_PACKAGES[sink]) is None:
            raise ImportError(
                f"POSTTRAIN_LOG_TO asks for {sink}, which is not installed: pip install {sink}"
            )
        if sink == "tensorboard":
            sinks.append(TensorBoardSink(directory))
        elif sink == "wandb":
            sinks.append(WandbSink(project, name))
        else:
            sinks.append(MLflowSink(project, name))
    return sinks
