"""LocalBackend: train in this process (CPU or one GPU) through a LocalTrainingClient; and
`InProcessBackend`, what it shares with RayBackend (whose workers are Ray actors): models kept
in directories with checkpoints, clients built here, sampling, the OpenAI endpoint."""

from __future__ import annotations

import asyncio
from abc import ABC
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, Unpack

from posttrain.backends.capabilities import LOCAL, Capabilities
from posttrain.backends.client_models import ModelClients
from posttrain.backends.engine_options import engine_config, trainer_device
from posttrain.backends.in_process import InProcessClients
from posttrain.backends.model import OpenAIEndpoint, TrainableModel
from posttrain.backends.openai_serving import OpenAIServer, start_openai_server
from posttrain.backends.options import (
    DPOOptions,
    LocalRLOptions,
    LocalSFTOptions,
    resolve_dpo,
    resolve_rl,
    resolve_sft,
)
from posttrain.backends.register_checks import preflight_register
from posttrain.backends.resume import DirectoryCheckpoints
from posttrain.clients.create import Head, create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.engine.devices import AUTO, resolve_device
from posttrain.inference.config import InferenceConfig
from posttrain.inference.model_sampler import ModelSampler
from posttrain.types import TrainResult

BACKEND = "LocalBackend"
ClientT = TypeVar("ClientT", LocalTrainingClient, RayTrainingClient)


class InProcessBackend(ABC, Generic[ClientT]):
    """A backend whose clients this process builds (`_make_client`): LocalBackend's own, or
    RayBackend's actors. Models live under `path/<project>/models/<name>/`, checkpointed every
    step by default; each subclass has its own typed `train` and constructor."""

    backend: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    sft_options: ClassVar[type] = LocalSFTOptions
    dpo_options: ClassVar[type] = DPOOptions

    def __init__(
        self,
        path: str | Path,
        *,
        inference: InferenceConfig,
        device: str,
        num_workers: int,
        micro_batch_tokens: int,
        gradient_checkpointing: bool,
        keep_checkpoints: int,
    ) -> None:
        self.inference = inference
        self.device = device
        self._models: ModelClients[ClientT] = ModelClients(
            path,
            backend=self.backend,
            capabilities=self.capabilities,
            clients=InProcessClients(self._make_client),
            index=DirectoryCheckpoints(keep_checkpoints),
            inference=self.inference,
            # A value model and a frozen base model: the policy's base, LoRA and placement.
            critics=InProcessClients(partial(self._make_client, head="value")),
            references=InProcessClients(partial(self._make_client, head="reference")),
        )
        self.path = Path(path)
        self.num_workers = num_workers
        self.micro_batch_tokens = micro_batch_tokens
        self.gradient_checkpointing = gradient_checkpointing
        self.keep_checkpoints = keep_checkpoints
        self._openai: OpenAIServer | None = None

    def _make_client(
        self, model: TrainableModel, directory: Path, head: Head = "policy"
    ) -> ClientT:
        raise NotImplementedError  # each backend builds its own kind of client

    def _client_options(self, model: TrainableModel, directory: Path, head: Head) -> dict[str, Any]:
        """What every client of `model` is built with, whatever runs it."""
        return {
            "lora_rank": model.lora_rank,
            "lora_alpha": model.lora_alpha,
            "train_attn": model.train_attn,
            "train_mlp": model.train_mlp,
            "train_unembed": model.train_unembed,
            "dtype": model.dtype,
            "device": self.device,
            "num_workers": self.num_workers,
            "micro_batch_tokens": self.micro_batch_tokens,
            "gradient_checkpointing": self.gradient_checkpointing,
            "storage_dir": directory,
            "seed": model.seed,
            "head": head,
        }

    def model_dir(self, model: TrainableModel) -> Path:
        return self._models.model_dir(model)

    def registered_models(self) -> list[TrainableModel]:
        return self._models.registered_models()

    def client(self, model: TrainableModel) -> ClientT:
        """The primitive-level client of a registered model (for power users)."""
        return self._models.client(model)

    def critic_client(self, model: TrainableModel) -> ClientT | None:
        """The primitive-level client of the model's critic (advantage_estimator='gae'): a
        value model whose passes return per-token values; None before its first 'gae' step."""
        return self._models.critic(model)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Trajectory],
        **options: Unpack[LocalSFTOptions],
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories` (any iterable, read once; their trainable
        segments), then one step."""
        config = resolve_sft(options, LocalSFTOptions, self.backend)
        return await self._models.train_sft(model, trajectories, config)

    async def train_dpo(
        self,
        model: TrainableModel,
        pairs: Iterable[PreferencePair],
        **options: Unpack[DPOOptions],
    ) -> TrainResult:
        """DPO (or IPO) on preference `pairs` (any iterable, read once), then one step."""
        config = resolve_dpo(options, DPOOptions, self.backend)
        return await self._models.train_dpo(model, pairs, config)

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's weights, optimizer, RNG and run_state now, as `checkpoints/<step>`.

        For a loop that logs a step before checkpointing it: `train(..., save_checkpoint=False)`,
        `model.log(...)`, then `checkpoint(model)`; a crash in between redoes the whole step.
        """
        return await self._models.checkpoint(model)

    def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps of the model's complete checkpoints, oldest first."""
        return self._models.checkpoint_steps(model)

    async def delete_checkpoints(self, model: TrainableModel, keep: set[int]) -> list[int]:
        """Delete the model's checkpoints of the steps not in `keep` (see
        `TrainableModel.delete_checkpoints`); returns the deleted steps."""
        return await self._models.delete_checkpoints(model, keep)

    def sampling_client(self, model: TrainableModel) -> ModelSampler:
        return self._models.sampling_client(model)

    def openai_endpoint(self, model: TrainableModel) -> OpenAIEndpoint:
        """Serve registered models' latest weights OpenAI-style on loopback (started on first
        call): requests sample through the model's client, in order with its training calls.

        The server comes from the server layer through `backends.openai_serving` (extra
        `server`); `close()` stops it.
        """
        self.client(model)  # the clear "not registered" error
        if self._openai is None:
            self._openai = start_openai_server(self)
        return self._openai.endpoint(model)

    async def close(self) -> None:
        """Stop the OpenAI endpoint and free every model's clients (and their workers)."""
        if self._openai is not None:
            await asyncio.to_thread(self._openai.stop)
            self._openai = None
        await self._models.close()


class LocalBackend(InProcessBackend[LocalTrainingClient]):
    """Models live under `path/<project>/models/<name>/`; checkpoints every step by default.

    `inference` chooses the sampling engine (`posttrain.inference.InferenceConfig`, or its
    fields as a dict): posttrain's sampler on the training weights by default, vLLM, or an
    OpenAI-compatible server; `devices` there splits sampling from training.

    `device="auto"` trains on CUDA where this machine has it, else on the CPU; an explicit
    "cuda" on a machine without CUDA is an error here, at construction.
    """

    backend: ClassVar[str] = BACKEND
    capabilities: ClassVar[Capabilities] = LOCAL
    rl_options: ClassVar[type] = LocalRLOptions

    def __init__(
        self,
        path: str | Path = ".posttrain",
        *,
        device: str = AUTO,
        num_workers: int = 1,
        micro_batch_tokens: int = 8192,
        gradient_checkpointing: bool = False,
        keep_checkpoints: int = 3,
        inference: InferenceConfig | Mapping[str, object] | None = None,
    ) -> None:
        config = engine_config(inference, BACKEND)
        super().__init__(
            path,
            inference=config,
            device=resolve_device(
                trainer_device(device, config, BACKEND), option=f"{BACKEND} device"
            ),
            num_workers=num_workers,
            micro_batch_tokens=micro_batch_tokens,
            gradient_checkpointing=gradient_checkpointing,
            keep_checkpoints=keep_checkpoints,
        )

    async def register(self, model: TrainableModel) -> None:
        """Load the base model, or resume the latest checkpoint; a base model this machine
        cannot get is an error before anything loads."""
        await preflight_register(BACKEND, model)
        await self._models.register(self, model)

    def _make_client(
        self, model: TrainableModel, directory: Path, head: Head = "policy"
    ) -> LocalTrainingClient:
        return create_training_client(
            model.base_model, **self._client_options(model, directory, head), executor="local"
        )

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        **options: Unpack[LocalRLOptions],
    ) -> TrainResult:
        """One RL step on `trajectory_groups` (any iterable, read once); returns the new step
        and its metrics."""
        config = resolve_rl(options, LocalRLOptions, BACKEND)
        return await self._models.train(model, trajectory_groups, config)
