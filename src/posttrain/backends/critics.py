"""A model's critic: the value model of PPO with a critic (`trainer.critic`).

Made on the base model at the model's first 'gae' step, saved before the policy with each of
its checkpoints (under the model's `critic/checkpoints/<step>`, so that a policy checkpoint of a
step implies its critic's), restored with the policy at register and after a failed step,
pruned with the policy's checkpoints, and freed with the model.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Generic

from posttrain.backends.checkpoint_index import ClientSource
from posttrain.backends.model import TrainableModel
from posttrain.backends.model_record import ClientT, ModelRecord
from posttrain.engine.checkpoint import is_complete_checkpoint, step_directories

log = logging.getLogger(__name__)
CRITIC_DIR = "critic"  # a model's critic: its checkpoints, under the model's directory


def critic_checkpoint(directory: Path, step: int) -> Path:
    """Where the critic saved with the policy checkpoint of `step` is."""
    return directory / CRITIC_DIR / "checkpoints" / str(step)


class Critics(Generic[ClientT]):
    """The critics of a backend's models, made by `source` (None: the backend has none)."""

    def __init__(self, source: ClientSource[ClientT] | None, backend: str) -> None:
        self.source = source
        self.backend = backend

    async def open_saved(self, model: TrainableModel, directory: Path, step: int) -> ClientT | None:
        """The critic saved with `step`'s checkpoint, if the run has one (None otherwise)."""
        if self.source is None:
            return None
        saved = critic_checkpoint(directory, step)
        if not is_complete_checkpoint(saved):
            return None
        return await self.source.open(model, directory / CRITIC_DIR, str(saved))

    async def of(self, record: ModelRecord[ClientT]) -> ClientT:
        """The model's critic: the one it has, else a new one on the base model."""
        if record.critic is not None:
            return record.critic
        if self.source is None:
            raise RuntimeError(f"{self.backend} has no critic (supports_critic=false)")
        model = record.model
        earlier = step_directories(model.directory / CRITIC_DIR / "checkpoints")
        if earlier:  # the run had a critic, but its step saved none (save_checkpoint=False)
            log.warning(
                "model %r starts a new critic at step %d: no critic was saved with that step "
                "(the last was at step %s), so its values start from the base model",
                model.name,
                model.step,
                earlier[-1].name,
            )
        record.critic = await self.source.open(model, model.directory / CRITIC_DIR, None)
        return record.critic

    async def save(self, record: ModelRecord[ClientT], step: int) -> None:
        if record.critic is not None:
            await record.critic.save_state(str(step))

    def prune(self, record: ModelRecord[ClientT]) -> None:
        """Drop the critics of steps whose policy checkpoint the index pruned."""
        if record.critic is None:
            return
        directory, step = record.model.directory, record.model.step
        kept = {p.name for p in step_directories(directory / "checkpoints")}
        for saved in step_directories(directory / CRITIC_DIR / "checkpoints"):
            if saved.name not in kept and int(saved.name) < step:
                shutil.rmtree(saved, ignore_errors=True)

    async def restore(self, record: ModelRecord[ClientT], error: Exception) -> None:
        """After a failed step: the critic of the model's step, or none (made anew when next
        needed) if that step saved no critic."""
        critic = record.critic
        if critic is None:
            return
        saved = critic_checkpoint(record.model.directory, record.model.step)
        try:
            if is_complete_checkpoint(saved):
                await critic.load_state(str(saved), with_optimizer=True)
                return
        except Exception as reload_error:
            error.add_note(f"reloading the critic from {saved} failed: {reload_error!r}")
        record.critic = None
        await self.release(critic)

    async def release(self, critic: ClientT) -> None:
        assert self.source is not None
        await self.source.release(critic)


def delete_saved_critic(directory: Path, step: int) -> None:
    """Delete the critic saved with the checkpoint of `step` (with that checkpoint)."""
    shutil.rmtree(critic_checkpoint(directory, step), ignore_errors=True)
