"""LocalBackend: train in this process (CPU or one GPU) through a LocalTrainingClient."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Unpack

from posttrain.backends.options import LocalRLOptions, SFTOptions, resolve_rl, resolve_sft
from posttrain.backends.sampling import SamplingClient
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.checkpoint import list_checkpoints, prune_checkpoints
from posttrain.model import TrainableModel
from posttrain.trainer.rl import train_rl_step
from posttrain.trainer.sft import train_sft
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import TrainResult, Trajectory, TrajectoryGroup

BACKEND = "LocalBackend"


class LocalBackend:
    """Models live under `path/<project>/models/<name>/`; checkpoints every step by default."""

    def __init__(
        self,
        path: str | Path = ".posttrain",
        *,
        device: str = "cpu",
        num_workers: int = 1,
        micro_batch_tokens: int = 8192,
        keep_checkpoints: int = 3,
    ) -> None:
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        self.path = Path(path)
        self.device = device
        self.num_workers = num_workers
        self.micro_batch_tokens = micro_batch_tokens
        self.keep_checkpoints = keep_checkpoints
        self._clients: dict[int, LocalTrainingClient] = {}

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(self, model: TrainableModel) -> None:
        directory = self.model_dir(model)
        _write_model_json(directory, model)
        client = await asyncio.to_thread(
            create_training_client,
            model.base_model,
            lora_rank=model.lora_rank,
            lora_alpha=model.lora_alpha,
            dtype=model.dtype,
            device=self.device,
            num_workers=self.num_workers,
            micro_batch_tokens=self.micro_batch_tokens,
            storage_dir=directory,
            seed=model.seed,
        )
        self._clients[id(model)] = client
        step = 0
        checkpoints = list_checkpoints(directory / "checkpoints")
        if checkpoints:
            latest = checkpoints[-1]
            await client.load_state(str(latest), with_optimizer=True)
            state = json.loads((latest / "trainer_state.json").read_text())
            step = int(state["step"])
            model.run_state = dict(state.get("run_state", {}))
        model.attach(self, directory, step)

    def client(self, model: TrainableModel) -> LocalTrainingClient:
        """The primitive-level client of a registered model (for power users)."""
        try:
            return self._clients[id(model)]
        except KeyError:
            raise RuntimeError(
                f"model {model.name!r} is not registered with this backend; "
                "call `await model.register(backend)` first"
            ) from None

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Sequence[TrajectoryGroup],
        **options: Unpack[LocalRLOptions],
    ) -> TrainResult:
        """One RL step on `trajectory_groups`; returns the new step and its metrics."""
        config = resolve_rl(options, LocalRLOptions, BACKEND)
        client = self.client(model)
        recorder = TensorRecorder() if config.plot_tensors else None
        metrics = await train_rl_step(client, trajectory_groups, config, recorder=recorder)
        step = model.step + 1
        model.set_step(step)
        if recorder is not None:
            recorder.save(model.directory / "plots" / f"step_{step:05d}.png")
        path = await self._checkpoint(model) if config.save_checkpoint else None
        return TrainResult(step=step, metrics=metrics.as_dict(), checkpoint_path=path)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Sequence[Trajectory],
        **options: Unpack[SFTOptions],
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories` (their trainable segments), then one step."""
        config = resolve_sft(options, BACKEND)
        metrics = await train_sft(self.client(model), trajectories, config)
        step = model.step + 1
        model.set_step(step)
        path = await self._checkpoint(model) if config.save_checkpoint else None
        return TrainResult(step=step, metrics=metrics.as_dict(), checkpoint_path=path)

    async def _checkpoint(self, model: TrainableModel) -> str:
        client = self.client(model)
        state = {"step": model.step, "run_state": model.run_state, "model": model.config_dict()}
        saved = await client.save_state(str(model.step), trainer_state=state)
        prune_checkpoints(model.directory / "checkpoints", self.keep_checkpoints)
        return saved.path

    def sampling_client(self, model: TrainableModel) -> SamplingClient:
        client = self.client(model)
        return SamplingClient(client, client.get_tokenizer())

    async def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _write_model_json(directory: Path, model: TrainableModel) -> None:
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
