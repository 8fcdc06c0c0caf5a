"""posttrain: post-train language models with RL and SFT on one training core, many backends."""

from typing import TYPE_CHECKING

from posttrain.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TokenSegment,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)

if TYPE_CHECKING:
    from posttrain.backends.local import LocalBackend
    from posttrain.backends.protocol import TrainableBackend
    from posttrain.backends.ray import RayBackend
    from posttrain.backends.tinker import TinkerBackend
    from posttrain.clients.create import create_training_client
    from posttrain.environments import Environment, run_episodes
    from posttrain.evaluation import Evaluation, evaluate
    from posttrain.gather import gather_trajectory_groups
    from posttrain.jobs.sft_data import load_sft_dataset
    from posttrain.model import TrainableModel
    from posttrain.rollout import TrajectoryBuilder, gather_groups
    from posttrain.tasks import DatasetTask, Problem, ResolvedTask, Task, resolve_task

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The heavier pieces import torch and transformers; load them on first use only.
    lazy = {
        "TrainableModel": "posttrain.model",
        "LocalBackend": "posttrain.backends.local",
        "TrainableBackend": "posttrain.backends.protocol",
        "RayBackend": "posttrain.backends.ray",
        "TinkerBackend": "posttrain.backends.tinker",
        "create_training_client": "posttrain.clients.create",
        "Environment": "posttrain.environments",
        "run_episodes": "posttrain.environments",
        "gather_groups": "posttrain.rollout",
        "gather_trajectory_groups": "posttrain.gather",
        "TrajectoryBuilder": "posttrain.rollout",
        "load_sft_dataset": "posttrain.jobs.sft_data",
        "evaluate": "posttrain.evaluation",
        "Evaluation": "posttrain.evaluation",
        "DatasetTask": "posttrain.tasks",
        "Problem": "posttrain.tasks",
        "ResolvedTask": "posttrain.tasks",
        "Task": "posttrain.tasks",
        "resolve_task": "posttrain.tasks",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")


__all__ = [
    "AdamParams",
    "DatasetTask",
    "Datum",
    "EncodedTextChunk",
    "Environment",
    "Evaluation",
    "LocalBackend",
    "ModelInput",
    "Problem",
    "RayBackend",
    "ResolvedTask",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "Task",
    "TinkerBackend",
    "TokenSegment",
    "TrainResult",
    "TrainableBackend",
    "TrainableModel",
    "Trajectory",
    "TrajectoryBuilder",
    "TrajectoryGroup",
    "__version__",
    "create_training_client",
    "evaluate",
    "gather_groups",
    "gather_trajectory_groups",
    "load_sft_dataset",
    "resolve_task",
    "run_episodes",
]
