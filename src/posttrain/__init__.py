"""posttrain: post-train language models with RL and SFT on one training core, many backends.

`import posttrain` imports none of posttrain's modules: each name below loads its module on
first use (most import torch). Everything not listed stays importable from its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The public API, each name with the module that defines it. `__all__`, attribute access and
# `dir()` derive from it; the imports below repeat it for type checkers only, and
# tests/test_public_api.py checks that the two agree.
_EXPORTS = {
    # data: what rollouts produce and backends train on; Tinker's primitive types
    "Trajectory": "posttrain.data.trajectories",
    "TrajectoryGroup": "posttrain.data.trajectories",
    "PreferencePair": "posttrain.data.preferences",
    "TrainResult": "posttrain.types",
    "SamplingParams": "posttrain.types",
    "AdamParams": "posttrain.types",
    "Datum": "posttrain.types",
    "ModelInput": "posttrain.types",
    # models and backends, and what a backend trains or samples with
    "TrainableModel": "posttrain.backends.model",
    "Model": "posttrain.backends.model",
    "TrainableBackend": "posttrain.backends.protocol",
    "LocalBackend": "posttrain.backends.local",
    "RayBackend": "posttrain.backends.ray",
    "TinkerBackend": "posttrain.backends.tinker",
    "export_model": "posttrain.backends.export",
    "InferenceConfig": "posttrain.inference.config",
    "Teacher": "posttrain.clients.teacher",
    # losses and advantages: the algorithm core's entry points
    "register_loss": "posttrain.clients.custom_loss",
    "group_advantages": "posttrain.algo.advantages",
    # rollouts and data for training
    "TrajectoryBuilder": "posttrain.rollouts.builder",
    "gather_groups": "posttrain.rollouts.gather",
    "gather_trajectory_groups": "posttrain.rollouts.gather",
    "sample_groups": "posttrain.rollouts.task_rollouts",
    "sft_examples": "posttrain.rollouts.task_rollouts",
    "load_sft_dataset": "posttrain.rollouts.sft_data",
    "preference_pair_from_chat": "posttrain.rollouts.dpo_data",
    "rl_steps": "posttrain.jobs.pipeline",
    # tasks, environments, evaluation
    "Task": "posttrain.tasks.protocol",
    "Problem": "posttrain.tasks.protocol",
    "DatasetTask": "posttrain.tasks.dataset",
    "resolve_task": "posttrain.tasks.resolve",
    "Environment": "posttrain.environments.protocol",
    "run_episodes": "posttrain.environments.runner",
    "evaluate": "posttrain.rollouts.evaluation",
    # building blocks
    "create_training_client": "posttrain.clients.create",
    "make_tiny_model": "posttrain.models.tiny",
}

if TYPE_CHECKING:
    from posttrain.algo.advantages import group_advantages as group_advantages
    from posttrain.backends.export import export_model as export_model
    from posttrain.backends.local import LocalBackend as LocalBackend
    from posttrain.backends.model import Model as Model
    from posttrain.backends.model import TrainableModel as TrainableModel
    from posttrain.backends.protocol import TrainableBackend as TrainableBackend
    from posttrain.backends.ray import RayBackend as RayBackend
    from posttrain.backends.tinker import TinkerBackend as TinkerBackend
    from posttrain.clients.create import create_training_client as create_training_client
    from posttrain.clients.custom_loss import register_loss as register_loss
    from posttrain.clients.teacher import Teacher as Teacher
    from posttrain.data.preferences import PreferencePair as PreferencePair
    from posttrain.data.trajectories import Trajectory as Trajectory
    from posttrain.data.trajectories import TrajectoryGroup as TrajectoryGroup
    from posttrain.environments.protocol import Environment as Environment
    from posttrain.environments.runner import run_episodes as run_episodes
    from posttrain.inference.config import InferenceConfig as InferenceConfig
    from posttrain.jobs.pipeline import rl_steps as rl_steps
    from posttrain.models.tiny import make_tiny_model as make_tiny_model
    from posttrain.rollouts.builder import TrajectoryBuilder as TrajectoryBuilder
    from posttrain.rollouts.dpo_data import preference_pair_from_chat as preference_pair_from_chat
    from posttrain.rollouts.evaluation import evaluate as evaluate
    from posttrain.rollouts.gather import gather_groups as gather_groups
    from posttrain.rollouts.gather import gather_trajectory_groups as gather_trajectory_groups
    from posttrain.rollouts.sft_data import load_sft_dataset as load_sft_dataset
    from posttrain.rollouts.task_rollouts import sample_groups as sample_groups
    from posttrain.rollouts.task_rollouts import sft_examples as sft_examples
    from posttrain.tasks.dataset import DatasetTask as DatasetTask
    from posttrain.tasks.protocol import Problem as Problem
    from posttrain.tasks.protocol import Task as Task
    from posttrain.tasks.resolve import resolve_task as resolve_task
    from posttrain.types import AdamParams as AdamParams
    from posttrain.types import Datum as Datum
    from posttrain.types import ModelInput as ModelInput
    from posttrain.types import SamplingParams as SamplingParams
    from posttrain.types import TrainResult as TrainResult

__version__ = "0.1.0"
# Pyright reads only literal lists here; it takes the public names from the `X as X` imports.
__all__ = ["__version__", *_EXPORTS]  # pyright: ignore[reportUnsupportedDunderAll]

if not TYPE_CHECKING:  # type checkers see the imports above; an unknown name is their error

    def __getattr__(name: str) -> object:
        if name not in _EXPORTS:
            raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # found once; later lookups skip __getattr__
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
