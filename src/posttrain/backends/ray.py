"""RayBackend: the shared trainer on data-parallel Ray actor workers (one machine or a cluster).

Weights live on the workers, so it honours every LocalBackend option; its own option checks
that the replicas stayed bit-identical. Checkpoints are written by rank 0 under `path`, which
on a multi-node cluster must be storage every node sees.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Unpack

from typing_extensions import TypedDict

from posttrain.algo.config_fields import from_options, option
from posttrain.backends.capabilities import Capabilities
from posttrain.backends.client_models import ModelClients
from posttrain.backends.engine_options import engine_config
from posttrain.backends.in_process import InProcessClients
from posttrain.backends.model import OpenAIEndpoint, TrainableModel
from posttrain.backends.openai_serving import OpenAIServer, start_openai_server
from posttrain.backends.options import (
    CriticFields,
    DPOOptions,
    LocalSFTOptions,
    RLConfig,
    SFTConfig,
    check_options,
    document,
    resolve_dpo,
    resolve_sft,
)
from posttrain.backends.register_checks import preflight_register
from posttrain.backends.resume import DirectoryCheckpoints
from posttrain.clients.create import Head, create_training_client
from posttrain.clients.ray import RayTrainingClient
from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.engine.devices import AUTO, resolve_worker_device
from posttrain.engine.ray.actor import Sharding
from posttrain.engine.ray.executor import RayConfig, WorkerGroupError
from posttrain.inference.config import InferenceConfig
from posttrain.inference.model_sampler import ModelSampler
from posttrain.types import TrainResult

BACKEND = "RayBackend"


class RayFields(TypedDict, total=False):
    """Options only RayBackend has."""

    check_weights_in_sync: bool


class RayRLOptions(CriticFields, RayFields, total=False, closed=True):
    """RayBackend.train() options: LocalBackend's plus RayBackend's own."""


@dataclass(frozen=True)
class RayRLConfig(RLConfig):
    """Resolved RayBackend.train() options: RLConfig's plus RayBackend's own."""

    check_weights_in_sync: bool = option(
        False, "after the step, check that every replica holds the same weights"
    )


document(RayRLOptions, RayRLConfig)

RAY = Capabilities(
    reports_sync_loss=True,
    preserves_token_advantages=True,
    supports_checkpoint_resume=True,
    resume_runtime_dependent=False,  # plain checkpoint files: any backend can resume them
    supports_sft=True,
    supports_kl_reference=True,
    supports_sampling=True,
    device_kinds=("cpu", "cuda"),
    provides_token_entropies=True,  # its actors run engine.decode.sampler, as LocalBackend
    supports_critic=True,  # a second actor group, sharded like the policy's
)


class RayBackend:
    """`num_workers` Ray actors, one model replica each, gradients summed by torch.distributed.

    `address=None` starts a local Ray on 127.0.0.1 (shut down by `close()`); otherwise joins
    that cluster ("auto" for the one `ray start` made). `resources_per_worker` and
    `ray_config` (timeouts, threads, collective backend) are passed to the executor.
    `sharding="fsdp2"` shards each model's decoder across the workers with FSDP2 instead of
    holding a full replica on each (same results; see `engine.fsdp`), overriding
    `ray_config.sharding`. `device="auto"` is CUDA when each worker gets a GPU share
    (`resources_per_worker={"GPU": ...}`), else the CPU.
    """

    capabilities = RAY
    rl_options = RayRLOptions
    rl_config = RayRLConfig
    sft_options = LocalSFTOptions
    sft_config = SFTConfig
    dpo_options = DPOOptions

    def __init__(
        self,
        path: str | Path = ".posttrain",
        *,
        num_workers: int = 2,
        address: str | None = None,
        resources_per_worker: Mapping[str, float] | None = None,
        device: str = AUTO,
        micro_batch_tokens: int = 8192,
        gradient_checkpointing: bool = False,
        keep_checkpoints: int = 3,
        ray_config: RayConfig | None = None,
        sharding: Sharding | None = None,
        inference: InferenceConfig | Mapping[str, object] | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.inference = engine_config(inference, BACKEND)
        if self.inference.devices is not None:
            raise ValueError(
                f"{BACKEND} places its workers with resources_per_worker; [inference] devices "
                "is for LocalBackend. Give the engine its own resources instead (engine = "
                "'vllm' or 'openai')"
            )
        self._models: ModelClients[RayTrainingClient] = ModelClients(
            path,
            backend=BACKEND,
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
        self.address = address
        self.resources_per_worker = resources_per_worker
        given = (ray_config or RayConfig()).resources_per_worker
        gpus = float(
            (given if resources_per_worker is None else resources_per_worker).get("GPU", 0)
        )
        self.device = resolve_worker_device(device, gpus, option=f"{BACKEND} device")
        self.micro_batch_tokens = micro_batch_tokens
        self.gradient_checkpointing = gradient_checkpointing
        if sharding is not None:
            ray_config = replace(ray_config or RayConfig(), sharding=sharding)
        self.ray_config = ray_config
        self._openai: OpenAIServer | None = None

    def model_dir(self, model: TrainableModel) -> Path:
        return self._models.model_dir(model)

    async def register(self, model: TrainableModel) -> None:
        """Start the workers on the base model, or resume the latest checkpoint; a base model
        this machine cannot get is an error before any worker starts."""
        await preflight_register(BACKEND, model)
        await self._models.register(self, model)

    def _make_client(
        self, model: TrainableModel, directory: Path, head: Head = "policy"
    ) -> RayTrainingClient:
        return create_training_client(
            model.base_model,
            lora_rank=model.lora_rank,
            lora_alpha=model.lora_alpha,
            train_attn=model.train_attn,
            train_mlp=model.train_mlp,
            train_unembed=model.train_unembed,
            dtype=model.dtype,
            device=self.device,
            num_workers=self.num_workers,
            micro_batch_tokens=self.micro_batch_tokens,
            gradient_checkpointing=self.gradient_checkpointing,
            storage_dir=directory,
            seed=model.seed,
            head=head,
            executor="ray",
            address=self.address,
            resources_per_worker=self.resources_per_worker,
            ray_config=self.ray_config,
        )

    def registered_models(self) -> list[TrainableModel]:
        return self._models.registered_models()

    def client(self, model: TrainableModel) -> RayTrainingClient:
        """The primitive-level client of a registered model (for power users)."""
        return self._models.client(model)

    def critic_client(self, model: TrainableModel) -> RayTrainingClient | None:
        """The primitive-level client of the model's critic (advantage_estimator='gae'): a
        value model whose passes return per-token values; None before its first 'gae' step."""
        return self._models.critic(model)

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        **options: Unpack[RayRLOptions],
    ) -> TrainResult:
        """One RL step on `trajectory_groups` (any iterable, read once); returns the new step
        and its metrics."""
        check_options(options, RayRLOptions, BACKEND)
        config = from_options(RayRLConfig, options)
        result = await self._models.train(model, trajectory_groups, config)
        if config.check_weights_in_sync:
            await self.check_weights_in_sync(model)
        return result

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Trajectory],
        **options: Unpack[LocalSFTOptions],
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories` (any iterable, read once; their trainable
        segments), then one step."""
        config = resolve_sft(options, LocalSFTOptions, BACKEND)
        return await self._models.train_sft(model, trajectories, config)

    async def train_dpo(
        self,
        model: TrainableModel,
        pairs: Iterable[PreferencePair],
        **options: Unpack[DPOOptions],
    ) -> TrainResult:
        """DPO (or IPO) on preference `pairs` (any iterable, read once), then one step."""
        config = resolve_dpo(options, DPOOptions, BACKEND)
        return await self._models.train_dpo(model, pairs, config)

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's state now as `checkpoints/<step>` (see LocalBackend.checkpoint)."""
        return await self._models.checkpoint(model)

    def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps of the model's complete checkpoints, oldest first."""
        return self._models.checkpoint_steps(model)

    async def delete_checkpoints(self, model: TrainableModel, keep: set[int]) -> list[int]:
        """Delete the model's checkpoints of the steps not in `keep` (see
        `TrainableModel.delete_checkpoints`); returns the deleted steps."""
        return await self._models.delete_checkpoints(model, keep)

    async def check_weights_in_sync(self, model: TrainableModel) -> None:
        """Raise WorkerGroupError unless every replica holds bit-identical trainable weights
        (under FSDP each rank digests the gathered weights, so this checks the ranks agree)."""
        digests = await self.client(model).weight_digests()
        if len(set(digests)) != 1:
            raise WorkerGroupError(
                f"the {len(digests)} replicas of {model.name!r} hold different weights "
                f"(digests {[d[:12] for d in digests]}); resume from the last checkpoint"
            )

    def sampling_client(self, model: TrainableModel) -> ModelSampler:
        return self._models.sampling_client(model)

    def openai_endpoint(self, model: TrainableModel) -> OpenAIEndpoint:
        """Serve registered models' latest weights OpenAI-style on loopback (started on first
        call), as LocalBackend does: requests sample on the workers, through the model's client,
        in order with its training calls. `close()` stops it."""
        self.client(model)  # the clear "not registered" error
        if self._openai is None:
            self._openai = start_openai_server(self)
        return self._openai.endpoint(model)

    async def close(self) -> None:
        """Stop the OpenAI endpoint; free every model's actors, and the local Ray if this
        backend started it."""
        if self._openai is not None:
            await asyncio.to_thread(self._openai.stop)
            self._openai = None
        await self._models.close()
