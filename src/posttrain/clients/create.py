"""`create_training_client`: one call that assembles a ready training client.

`executor="local"` holds the workers in this process (LocalTrainingClient); `executor="ray"`
runs each as a Ray actor in a torch.distributed group (RayTrainingClient), with the same
methods and results.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.ray import RayTrainingClient
from posttrain.engine.dispatch import Dispatch, InProcessExecutor
from posttrain.engine.models import LoraSettings, apply_lora, load_hf_model, load_tokenizer
from posttrain.engine.ray_executor import RayConfig, RayExecutor
from posttrain.engine.worker import Worker, WorkerConfig

ExecutorKind = Literal["local", "ray"]


@dataclass(frozen=True)
class WorkerSpec:
    """What a process needs to build one worker replica; picklable, so Ray actors get it."""

    base_model: str
    lora: LoraSettings | None
    device: str
    dtype: str
    config: WorkerConfig
    seed: int

    def build(self) -> Worker:
        """Load the model and wrap it; the same spec gives bit-identical replicas anywhere."""
        torch.manual_seed(self.seed)  # LoRA's A matrices are drawn from torch's generator
        model = load_hf_model(self.base_model, dtype=self.dtype, device=self.device)
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        return Worker(
            model,
            self.config,
            tokenizer=load_tokenizer(self.base_model),
            reference_factory=self.reference_model,
        )

    def reference_model(self) -> torch.nn.Module:
        return load_hf_model(self.base_model, dtype=self.dtype, device=self.device)


def create_training_client(
    base_model: str | Path,
    *,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    train_attn: bool = True,
    train_mlp: bool = True,
    train_unembed: bool = True,
    device: str = "cpu",
    dtype: str = "float32",
    num_workers: int = 1,
    micro_batch_tokens: int = 8192,
    logprob_chunk_size: int = 1024,
    storage_dir: str | Path | None = None,
    seed: int = 0,
    executor: ExecutorKind = "local",
    address: str | None = None,
    resources_per_worker: Mapping[str, float] | None = None,
    ray_config: RayConfig | None = None,
) -> LocalTrainingClient:
    """Load `base_model` (a local directory or hub id), optionally wrap it with LoRA, and return
    a client over `num_workers` data-parallel replicas.

    `lora_rank=None` trains all weights. Replicas start bit-identical. With `executor="ray"`
    the result is a `RayTrainingClient`: `address=None` starts a local Ray, otherwise joins
    that cluster; `resources_per_worker` (e.g. {"CPU": 1, "GPU": 1}) and `address` override
    the fields of `ray_config` (timeouts, threads, collective backend).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
    if executor == "local" and (address, resources_per_worker, ray_config) != (None, None, None):
        raise ValueError("address, resources_per_worker and ray_config need executor='ray'")
    lora = None
    if lora_rank is not None:
        alpha = lora_alpha if lora_alpha is not None else LoraSettings.default_alpha(lora_rank)
        lora = LoraSettings(
            rank=lora_rank,
            alpha=alpha,
            train_attn=train_attn,
            train_mlp=train_mlp,
            train_unembed=train_unembed,
        )
    config = WorkerConfig(
        micro_batch_tokens=micro_batch_tokens, logprob_chunk_size=logprob_chunk_size, device=device
    )
    spec = WorkerSpec(str(base_model), lora, device, dtype, config, seed)
    storage = Path(storage_dir) if storage_dir else Path(tempfile.mkdtemp(prefix="posttrain-"))
    if executor == "ray":
        ray = ray_config or RayConfig()
        if address is not None:
            ray = replace(ray, address=address)
        if resources_per_worker is not None:
            ray = replace(ray, resources_per_worker=dict(resources_per_worker))
        if device.startswith("cuda") and ray.num_gpus <= 0:
            raise ValueError(f"device={device!r} needs resources_per_worker with a 'GPU' share > 0")
        workers = RayExecutor(spec.build, num_workers, ray, device=device)
        return RayTrainingClient(workers, storage_dir=storage, base_model=str(base_model))
    first = spec.build()
    workers = [first] + [
        Worker(
            copy.deepcopy(first.model),
            config,
            tokenizer=first.tokenizer,
            reference_factory=spec.reference_model,
        )
        for _ in range(num_workers - 1)
    ]
    return LocalTrainingClient(
        Dispatch(InProcessExecutor(workers)), storage_dir=storage, base_model=str(base_model)
    )
