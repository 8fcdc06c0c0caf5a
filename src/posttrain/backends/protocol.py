"""`TrainableBackend`: what backend-agnostic code may call on any backend."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, Unpack, runtime_checkable

from posttrain.backends.options import RLOptions, SFTOptions
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.types import TrainResult

if TYPE_CHECKING:
    from posttrain.backends.model import TrainableModel
    from posttrain.inference.model_sampler import ModelSampler


@runtime_checkable
class TrainableBackend(Protocol):
    """Every backend offers these with at least the shared options (`RLOptions`, `SFTOptions`).

    `train` and `train_sft` take any iterable (a generator included) and read it once."""

    async def register(self, model: TrainableModel) -> None: ...

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        **options: Unpack[RLOptions],
    ) -> TrainResult: ...

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Trajectory],
        **options: Unpack[SFTOptions],
    ) -> TrainResult: ...

    def sampling_client(self, model: TrainableModel) -> ModelSampler: ...

    async def close(self) -> None: ...


@runtime_checkable
class CheckpointsOnDemand(Protocol):
    """A backend that can checkpoint a model now, outside `train` (LocalBackend, RayBackend,
    TinkerBackend): a loop can then log a step before making it durable."""

    async def checkpoint(self, model: TrainableModel) -> str: ...
