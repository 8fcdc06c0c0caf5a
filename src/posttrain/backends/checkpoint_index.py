"""What the shared model lifecycle (`client_models.ModelClients`) asks of a backend.

A `ClientSource` makes, reloads and frees a model's training client. A `CheckpointIndex` keeps
its checkpoints: `resume.DirectoryCheckpoints` (LocalBackend, RayBackend), a directory per
step with its trainer state inside; `tinker_index.JsonlCheckpoints` (TinkerBackend),
`tinker://` paths on the service recorded with their trainer state in `checkpoints.jsonl`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from posttrain.backends.model import TrainableModel
from posttrain.trainer.steps import RunState

ClientT = TypeVar("ClientT")
ClientT_contra = TypeVar("ClientT_contra", contravariant=True)


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's weights and optimizer are, and the trainer state saved with it."""

    path: str
    step: int
    run_state: RunState


@dataclass(frozen=True)
class ResumePoint:
    """Where a registration starts (`checkpoint` None: the base model). `set_aside`, called once
    the registration succeeded, moves the checkpoints after an explicit `resume_step` aside."""

    checkpoint: Checkpoint | None
    set_aside: Callable[[], None]


class CheckpointIndex(Protocol[ClientT_contra]):
    def resume_point(
        self, model: TrainableModel, directory: Path, resume_step: int | None
    ) -> ResumePoint:
        """The latest checkpoint, which must be intact (else `DamagedCheckpointError`), or with
        `resume_step` that step's (0 with none: the base model; else a ValueError)."""
        ...

    def checkpoint_of(self, directory: Path, step: int) -> str | None:
        """The intact checkpoint of `step`, to reload after a failed step."""
        ...

    async def save(self, client: ClientT_contra, model: TrainableModel, step: int) -> str:
        """Save the client's state and the model's trainer state as the checkpoint of `step`;
        if that fails, a step not yet counted (`step > model.step`) keeps no checkpoint."""
        ...


class ClientSource(Protocol[ClientT]):
    async def open(self, model: TrainableModel, directory: Path, checkpoint: str | None) -> ClientT:
        """A client on the base model, or on `checkpoint`'s weights and optimizer."""
        ...

    async def reload(self, client: ClientT, checkpoint: str) -> ClientT:
        """`client` put back to `checkpoint`: itself, or a new client (`client` is then freed)."""
        ...

    async def release(self, client: ClientT) -> None: ...
