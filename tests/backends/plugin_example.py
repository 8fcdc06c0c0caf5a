"""Example plugin backends for the registry, preflight and job tests.

`LocalPlugin` trains for real (it wraps LocalBackend) and declares itself through class hooks:
it does not preserve token-level advantages and offers fewer losses than LocalBackend.
`KeyedPlugin` is LocalPlugin that needs an API key and declares no `save_checkpoint` (its calls
always checkpoint).
`HookedBackend` only declares; `PlainBackend` has no hooks (conservative defaults);
`BrokenBackend` and `RaisingBackend` have malformed hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.inference.model_sampler import ModelSampler
from posttrain.types import TrainResult


def _option(
    name: str, type_: str, default: object, choices: list[str] | None = None
) -> dict[str, object]:
    return {
        "name": name,
        "type": type_,
        "default": default,
        "choices": choices,
        "description": f"{name} (LocalPlugin)",
    }


class LocalPlugin:
    """LocalBackend behind a plugin's face; records each call so tests see it was used."""

    calls: list[str] = []  # noqa: RUF012 - shared on purpose: tests read what the job called

    def __init__(
        self, path: str | Path, *, keep_checkpoints: int = 2, micro_batch_tokens: int = 8192
    ) -> None:
        self.inner = LocalBackend(
            path, keep_checkpoints=keep_checkpoints, micro_batch_tokens=micro_batch_tokens
        )
        self.micro_batch_tokens = micro_batch_tokens

    @staticmethod
    def posttrain_capabilities() -> dict[str, object]:
        return {
            "reports_sync_loss": True,
            "preserves_token_advantages": False,
            "supports_checkpoint_resume": True,
            "resume_runtime_dependent": False,
            "supports_sft": True,
            "supports_kl_reference": False,
            "supports_sampling": True,
            "device_kinds": ["cpu"],
        }

    @classmethod
    def posttrain_option_schema(cls) -> dict[str, list[dict[str, object]]]:
        return {
            "train": [
                _option("learning_rate", "float", 1e-5),
                _option("loss", "str", "ppo", ["ppo", "cispo"]),
                _option("kimi_k2_tau", "float | null", None),
                _option("save_checkpoint", "bool", True),
            ],
            "train_sft": [
                _option(name, type_, default)
                for name, type_, default in (
                    ("learning_rate", "float", 1e-4),
                    ("lr_schedule", "str", "cosine"),
                    ("batch_size", "int", 8),
                    ("epochs", "int", 1),
                    ("save_checkpoint", "bool", True),
                )
            ],
        }

    async def register(self, model: TrainableModel) -> None:
        self.calls.append("register")
        await self.inner.register(model)

    async def train(
        self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], **options: Any
    ) -> TrainResult:
        self.calls.append(f"train {sorted(options)}")
        return await self.inner.train(model, trajectory_groups, **options)

    async def train_sft(
        self, model: TrainableModel, trajectories: Iterable[Trajectory], **options: Any
    ) -> TrainResult:
        self.calls.append(f"train_sft {sorted(options)}")
        return await self.inner.train_sft(model, trajectories, **options)

    def sampling_client(self, model: TrainableModel) -> ModelSampler:
        return self.inner.sampling_client(model)

    async def close(self) -> None:
        await self.inner.close()


class KeyedPlugin(LocalPlugin):
    """LocalPlugin with a required `api_key`, without the `save_checkpoint` option."""

    def __init__(self, path: str | Path, *, api_key: str, keep_checkpoints: int = 2) -> None:
        super().__init__(path, keep_checkpoints=keep_checkpoints)
        self.api_key = api_key

    hook_calls: list[str] = []  # noqa: RUF012 - tests count how often the job asks

    @classmethod
    def posttrain_option_schema(cls) -> dict[str, list[dict[str, object]]]:
        cls.hook_calls.append("posttrain_option_schema")
        return {
            call: [o for o in options if o["name"] != "save_checkpoint"]
            for call, options in LocalPlugin.posttrain_option_schema().items()
        }


class HookedBackend:
    """A remote-style backend that declares what it can do through hooks."""

    @staticmethod
    def posttrain_capabilities() -> dict[str, object]:
        local = LocalPlugin.posttrain_capabilities()
        return {**local, "resume_runtime_dependent": True, "device_kinds": ["remote"]}

    @staticmethod
    def posttrain_option_schema() -> dict[str, list[dict[str, object]]]:
        return {"train": [_option("learning_rate", "float", 1e-5)]}


class PlainBackend:
    """No hooks at all: conservative capabilities."""


class BrokenBackend:
    """Its capabilities hook leaves out keys and gives a string for a flag."""

    @staticmethod
    def posttrain_capabilities() -> dict[str, object]:
        return {"reports_sync_loss": "yes"}


class RaisingBackend:
    """Its option-schema hook raises."""

    @staticmethod
    def posttrain_option_schema() -> dict[str, list[dict[str, object]]]:
        raise RuntimeError("schema server unreachable")


class BadSchemaBackend:
    """An option without a description."""

    @classmethod
    def posttrain_option_schema(cls) -> dict[str, list[dict[str, object]]]:
        return {
            "train": [
                {
                    "name": "learning_rate",
                    "type": "float",
                    "default": 1e-5,
                    "choices": None,
                    "description": "",
                }
            ]
        }
