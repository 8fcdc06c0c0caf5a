"""RayBackend: the shared trainer on data-parallel Ray actor workers (one machine or a cluster).

Weights live on the workers, so it honours every LocalBackend option; its own option checks
that the replicas stayed bit-identical. Checkpoints are written by rank 0 under `path`, which
on a multi-node cluster must be storage every node sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Unpack

from typing_extensions import TypedDict

from posttrain.algo.config_fields import from_options, option
from posttrain.backends.capabilities import Capabilities
from posttrain.backends.engine_options import engine_config
from posttrain.backends.local import InProcessBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.options import (
    CriticFields,
    RLConfig,
    SFTConfig,
    check_options,
    document,
)
from posttrain.backends.register_checks import preflight_register
from posttrain.clients.create import Head, create_training_client
from posttrain.clients.ray import RayTrainingClient
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.engine.devices import AUTO, resolve_worker_device
from posttrain.engine.ray.actor import Sharding
from posttrain.engine.ray.executor import RayConfig, WorkerGroupError
from posttrain.inference.config import InferenceConfig
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


class RayBackend(InProcessBackend[RayTrainingClient]):
    """`num_workers` Ray actors, one model replica each, gradients summed by torch.distributed.

    `address=None` starts a local Ray on 127.0.0.1 (shut down by `close()`); otherwise joins
    that cluster ("auto" for the one `ray start` made). `resources_per_worker` and
    `ray_config` (timeouts, threads, collective backend) are passed to the executor.
    `sharding="fsdp2"` shards each model's decoder across the workers with FSDP2 instead of
    holding a full replica on each (same results; see `engine.fsdp`), overriding
    `ray_config.sharding`. `device="auto"` is CUDA when each worker gets a GPU share
    (`resources_per_worker={"GPU": ...}`), else the CPU. Everything else is LocalBackend's
    (`InProcessBackend`): directories, checkpoints, sampling, the OpenAI endpoint.
    """

    backend: ClassVar[str] = BACKEND
    capabilities: ClassVar[Capabilities] = RAY
    rl_options: ClassVar[type] = RayRLOptions
    rl_config: ClassVar[type] = RayRLConfig
    sft_config: ClassVar[type] = SFTConfig

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
        config = engine_config(inference, BACKEND)
        if config.devices is not None:
            raise ValueError(
                f"{BACKEND} places its workers with resources_per_worker; [inference] devices "
                "is for LocalBackend. Give the engine its own resources instead (engine = "
                "'vllm' or 'openai')"
            )
        given = (ray_config or RayConfig()).resources_per_worker
        gpus = float(
            (given if resources_per_worker is None else resources_per_worker).get("GPU", 0)
        )
        super().__init__(
            path,
            inference=config,
            device=resolve_worker_device(device, gpus, option=f"{BACKEND} device"),
            num_workers=num_workers,
            micro_batch_tokens=micro_batch_tokens,
            gradient_checkpointing=gradient_checkpointing,
            keep_checkpoints=keep_checkpoints,
        )
        self.address = address
        self.resources_per_worker = resources_per_worker
        if sharding is not None:
            ray_config = replace(ray_config or RayConfig(), sharding=sharding)
        self.ray_config = ray_config

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
            **self._client_options(model, directory, head),
            executor="ray",
            address=self.address,
            resources_per_worker=self.resources_per_worker,
            ray_config=self.ray_config,
        )

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        **options: Unpack[RayRLOptions],
    ) -> TrainResult:
        """LocalBackend.train's RL step on the workers; with check_weights_in_sync, a check
        afterwards that every replica holds the same weights."""
        check_options(options, RayRLOptions, BACKEND)
        config = from_options(RayRLConfig, options)
        result = await self._models.train(model, trajectory_groups, config)
        if config.check_weights_in_sync:
            await self.check_weights_in_sync(model)
        return result

    async def check_weights_in_sync(self, model: TrainableModel) -> None:
        """Raise WorkerGroupError unless every replica holds bit-identical trainable weights
        (under FSDP each rank digests the gathered weights, so this checks the ranks agree)."""
        digests = await self.client(model).weight_digests()
        if len(set(digests)) != 1:
            raise WorkerGroupError(
                f"the {len(digests)} replicas of {model.name!r} hold different weights "
                f"(digests {[d[:12] for d in digests]}); resume from the last checkpoint"
            )
