"""What every backend over a posttrain training client does the same way.

`ModelClients` keeps the models a backend registered, each with its training client, and
runs the shared trainer on them: register (or resume from the latest checkpoint), one RL or
SFT step, checkpoint with retention, close. LocalBackend and RayBackend each hold one and
differ only in how a client is made.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from posttrain.backends.capabilities import Capabilities
from posttrain.backends.preflight import preflight_rl, preflight_sft
from posttrain.backends.protocol import TrainableBackend
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.checkpoint import list_checkpoints, prune_checkpoints
from posttrain.model import TrainableModel
from posttrain.trainer.config import RLConfig, SFTConfig
from posttrain.trainer.rl import train_rl_step
from posttrain.trainer.sft import train_sft
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import TrainResult, Trajectory, TrajectoryGroup

ClientT = TypeVar("ClientT", bound=LocalTrainingClient)


class ModelClients(Generic[ClientT]):
    """Models under `path/<project>/models/<name>/`, each with its client and checkpoints."""

    def __init__(
        self,
        path: str | Path,
        keep_checkpoints: int,
        *,
        backend: str,
        capabilities: Capabilities,
    ) -> None:
        self.backend = backend
        self.capabilities = capabilities
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        self.path = Path(path)
        self.keep_checkpoints = keep_checkpoints
        self._clients: dict[int, ClientT] = {}

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(
        self,
        backend: TrainableBackend,
        model: TrainableModel,
        make_client: Callable[[Path], ClientT],
    ) -> None:
        """Create the model's client (`make_client(directory)`), resume its latest checkpoint."""
        directory = self.model_dir(model)
        write_model_json(directory, model)
        client = await asyncio.to_thread(make_client, directory)
        self._clients[id(model)] = client
        step = 0
        checkpoints = list_checkpoints(directory / "checkpoints")
        if checkpoints:
            latest = checkpoints[-1]
            await client.load_state(str(latest), with_optimizer=True)
            state = json.loads((latest / "trainer_state.json").read_text())
            step = int(state["step"])
            model.run_state = dict(state.get("run_state", {}))
        model.attach(backend, directory, step)

    def client(self, model: TrainableModel) -> ClientT:
        try:
            return self._clients[id(model)]
        except KeyError:
            raise RuntimeError(
                f"model {model.name!r} is not registered with this backend; "
                "call `await model.register(backend)` first"
            ) from None

    async def train(
        self, model: TrainableModel, groups: Sequence[TrajectoryGroup], config: RLConfig
    ) -> TrainResult:
        """Preflight, one RL step through the shared trainer, then the step and a checkpoint."""
        preflight_rl(self.backend, self.capabilities, config, groups)
        client = self.client(model)
        client.set_logprob_chunk_size(config.logprob_calculation_chunk_size)
        recorder = TensorRecorder() if config.plot_tensors else None
        metrics = await train_rl_step(client, groups, config, recorder=recorder)
        step = model.step + 1
        model.set_step(step)
        if recorder is not None:
            recorder.save(model.directory / "plots" / f"step_{step:05d}.png")
        path = await self.checkpoint(model) if config.save_checkpoint else None
        return TrainResult(step=step, metrics=metrics.as_dict(), checkpoint_path=path)

    async def train_sft(
        self, model: TrainableModel, trajectories: Sequence[Trajectory], config: SFTConfig
    ) -> TrainResult:
        preflight_sft(self.backend, self.capabilities, config)
        metrics = await train_sft(self.client(model), trajectories, config)
        step = model.step + 1
        model.set_step(step)
        path = await self.checkpoint(model) if config.save_checkpoint else None
        return TrainResult(step=step, metrics=metrics.as_dict(), checkpoint_path=path)

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save under `checkpoints/<step>` with the trainer state, keep the newest few."""
        client = self.client(model)
        state = {"step": model.step, "run_state": model.run_state, "model": model.config_dict()}
        saved = await client.save_state(str(model.step), trainer_state=state)
        prune_checkpoints(model.directory / "checkpoints", self.keep_checkpoints)
        return saved.path

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def write_model_json(directory: Path, model: TrainableModel) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.json"
    config = model.config_dict()
    if path.exists():
        saved = json.loads(path.read_text())
        if (
            saved.get("base_model") != config["base_model"]
            or saved.get("lora_rank") != config["lora_rank"]
        ):
            raise ValueError(
                f"{directory} already holds model {model.name!r} with base_model="
                f"{saved.get('base_model')!r}, lora_rank={saved.get('lora_rank')!r}; use another "
                "name or the same settings"
            )
    path.write_text(json.dumps(config, indent=2) + "\n")
