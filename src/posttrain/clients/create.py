"""`create_training_client`: one call that assembles a ready training client.

`executor="local"` holds the workers in this process (LocalTrainingClient); `executor="ray"`
runs each as a Ray actor in a torch.distributed group (RayTrainingClient), with the same
methods and results. The Ray modules are imported only on that path.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

import torch

from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.compute_thread import ComputeThread
from posttrain.engine.devices import AUTO, resolve_device, resolve_worker_device
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.executor import InProcessExecutor
from posttrain.engine.placement import parks_for_sampling
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.load import (
    apply_lora,
    check_trainable_dtype,
    load_hf_model,
    load_tokenizer,
    parse_dtype,
)
from posttrain.models.lora import DEFAULT_LORA_RANK, LoraSettings
from posttrain.models.shared_base import SharedBases
from posttrain.models.value_head import VALUE_HEAD_MODULE, to_value_model

if TYPE_CHECKING:
    from posttrain.clients.ray import RayTrainingClient
    from posttrain.engine.ray.executor import RayConfig

ExecutorKind = Literal["local", "ray"]
# "policy": the causal LM; "value": a critic, the same model with a scalar head
# (`models.value_head`), whose passes give per-token values instead of logprobs; "reference":
# the base model whole and never trained, whose `reference_logprobs` are its own (the frozen
# KL / DPO reference of a fully fine-tuned policy, in workers of its own).
Head = Literal["policy", "value", "reference"]


@dataclass(frozen=True)
class WorkerSpec:
    """What a process needs to build one worker replica; picklable, so Ray actors get it."""

    base_model: str
    lora: LoraSettings | None
    device: str
    dtype: str
    config: WorkerConfig
    seed: int
    head: Head = "policy"
    # The base's weights come from here, shared with other clients of it (local only).
    bases: SharedBases | None = field(default=None, compare=False, repr=False)

    def build(self) -> Worker:
        """Load the model and wrap it; the same spec gives bit-identical replicas anywhere.

        LoRA's random A matrices come from `seed` through a forked generator, so building a
        worker leaves torch's global random state as it was. They are drawn on the CPU and the
        model moves to its device afterwards: the CUDA generator draws other numbers from the
        same seed, and a run should start from the same adapters on any device. A critic's
        value head trains whole beside the adapters (never a LoRA of its own: it is one row).
        """
        # from_pretrained builds on the CPU anyway: moving after wrapping costs nothing more.
        if self.bases is not None:
            model = self.bases.model(self.base_model, self.dtype, self.device)
        else:
            model = load_hf_model(self.base_model, dtype=self.dtype, device="cpu")
        if self.head == "value":
            model = to_value_model(model)
        if self.lora is not None and self.head == "value":
            lora = replace(self.lora, train_unembed=False)
            model = apply_lora(model, lora, seed=self.seed, modules_to_save=[VALUE_HEAD_MODULE])
        elif self.lora is not None and self.head == "policy":
            model = apply_lora(model, self.lora, seed=self.seed)
        model.to(self.device)  # pyright: ignore[reportArgumentType]  # HF types `to` narrowly
        return Worker(
            model,
            self.config,
            tokenizer=(
                self.bases.tokenizer(self.base_model)
                if self.bases is not None
                else load_tokenizer(self.base_model)
            ),
            # A reference model scores with itself; a policy builds a frozen copy when asked.
            reference_factory=None if self.head == "reference" else self.reference_model,
        )

    def on_cpu(self) -> WorkerSpec:
        """The same replica built on the CPU (FSDP2's checkpoint replica on rank 0)."""
        return replace(self, device="cpu", config=replace(self.config, device="cpu"))

    def reference_model(self) -> torch.nn.Module:
        return load_hf_model(self.base_model, dtype=self.dtype, device=self.device)


@overload
def create_training_client(
    base_model: str | Path,
    *,
    lora_rank: int | None = ...,
    lora_alpha: float | None = ...,
    train_attn: bool = ...,
    train_mlp: bool = ...,
    train_unembed: bool | None = ...,
    device: str = ...,
    dtype: str = ...,
    num_workers: int = ...,
    micro_batch_tokens: int = ...,
    logprob_chunk_size: int = ...,
    gradient_checkpointing: bool = ...,
    park_for_sampling: bool | None = ...,
    storage_dir: str | Path | None = ...,
    seed: int = ...,
    head: Head = ...,
    executor: Literal["local"] = ...,
    compute_thread: ComputeThread | None = ...,
    shared_base: SharedBases | None = ...,
) -> LocalTrainingClient: ...


@overload
def create_training_client(
    base_model: str | Path,
    *,
    lora_rank: int | None = ...,
    lora_alpha: float | None = ...,
    train_attn: bool = ...,
    train_mlp: bool = ...,
    train_unembed: bool | None = ...,
    device: str = ...,
    dtype: str = ...,
    num_workers: int = ...,
    micro_batch_tokens: int = ...,
    logprob_chunk_size: int = ...,
    gradient_checkpointing: bool = ...,
    park_for_sampling: bool | None = ...,
    storage_dir: str | Path | None = ...,
    seed: int = ...,
    head: Head = ...,
    executor: Literal["ray"],
    address: str | None = ...,
    resources_per_worker: Mapping[str, float] | None = ...,
    ray_config: RayConfig | None = ...,
) -> RayTrainingClient: ...


def create_training_client(
    base_model: str | Path,
    *,
    lora_rank: int | None = DEFAULT_LORA_RANK,
    lora_alpha: float | None = None,
    train_attn: bool = True,
    train_mlp: bool = True,
    train_unembed: bool | None = None,
    device: str = AUTO,
    dtype: str = "float32",
    num_workers: int = 1,
    micro_batch_tokens: int = 8192,
    logprob_chunk_size: int = 1024,
    gradient_checkpointing: bool = False,
    park_for_sampling: bool | None = None,
    storage_dir: str | Path | None = None,
    seed: int = 0,
    head: Head = "policy",
    executor: ExecutorKind = "local",
    address: str | None = None,
    resources_per_worker: Mapping[str, float] | None = None,
    ray_config: RayConfig | None = None,
    compute_thread: ComputeThread | None = None,
    shared_base: SharedBases | None = None,
) -> LocalTrainingClient | RayTrainingClient:
    """Load `base_model` (a local directory or hub id), optionally wrap it with LoRA, and return
    a client over `num_workers` data-parallel replicas.

    `lora_rank` is LoRA's rank, by default Tinker's 32 (`DEFAULT_LORA_RANK`, as
    `create_lora_training_client`); `lora_rank=None` (or 0) trains all weights, in float32 only; `dtype="bfloat16"` is for LoRA on a
    bf16 base (float32 adapters). `train_unembed=None` adapts the unembedding unless the model
    ties it to the input embedding; True adapts a tied one too (`models.lora.LoraSettings`).
    `gradient_checkpointing=True` recomputes each decoder layer in backward: less memory, about
    a third more compute, the same gradients. Replicas start bit-identical. `device="auto"` is
    CUDA where this machine has it, else the CPU; an explicit "cuda" without CUDA is an error.
    With `executor="ray"` the result is a `RayTrainingClient`: `address=None` starts a local
    Ray, otherwise joins that cluster; `resources_per_worker` (e.g. {"CPU": 1, "GPU": 1}) and
    `address` override the fields of `ray_config` (timeouts, threads, collective backend), and
    "auto" is CUDA when each worker gets a GPU share. `compute_thread` (local only) runs the
    client's calls on that thread, shared with other clients, instead of a thread of its own.
    `shared_base` (local only) takes the base's weights from there, shared with the other
    clients built from it (`models.shared_base`): a LoRA policy or a reference model only,
    since full fine-tuning would write the weights the others read.
    `head="value"` makes a critic (`models.value_head`): its passes return per-token values.
    `head="reference"` makes a frozen base model (no LoRA) that scores `reference_logprobs`.
    `park_for_sampling` moves gradients and AdamW moments off the device while sampling, to
    give the KV cache their room; None decides by size (`placement.parks_for_sampling`: on a
    GPU, only when they would take more than a quarter of it; Ray workers always park).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', got {executor!r}")
    if executor == "local" and (address, resources_per_worker, ray_config) != (None, None, None):
        raise ValueError("address, resources_per_worker and ray_config need executor='ray'")
    if executor == "ray" and compute_thread is not None:
        raise ValueError("compute_thread needs executor='local': Ray workers compute elsewhere")
    if executor == "ray" and shared_base is not None:
        raise ValueError("shared_base needs executor='local': Ray workers load their own model")
    parse_dtype(dtype)  # a bad dtype fails here, before any model loads or Ray starts
    ray = None
    if executor == "ray":
        ray = _ray_config(ray_config, address, resources_per_worker)
        device = resolve_worker_device(device, ray.num_gpus, option="device")
    else:
        device = resolve_device(device, option="device")
    lora = LoraSettings.of(lora_rank, lora_alpha, train_attn, train_mlp, train_unembed)
    check_trainable_dtype(dtype, lora=lora is not None)
    config = WorkerConfig(
        micro_batch_tokens=micro_batch_tokens,
        logprob_chunk_size=logprob_chunk_size,
        device=device,
        gradient_checkpointing=gradient_checkpointing,
    )
    if head not in ("policy", "value", "reference"):
        raise ValueError(f"head must be 'policy', 'value' or 'reference', got {head!r}")
    if shared_base is not None and not (
        head == "reference" or (head == "policy" and lora is not None)
    ):
        raise ValueError(
            "shared_base is for LoRA policies and reference models: full fine-tuning (or a "
            "critic's value head) trains the base weights, which the other clients read; "
            "give a lora_rank, or leave shared_base unset for a model of its own"
        )
    spec = WorkerSpec(str(base_model), lora, device, dtype, config, seed, head, shared_base)
    storage = Path(storage_dir) if storage_dir else Path(tempfile.mkdtemp(prefix="posttrain-"))
    if ray is not None:
        client = _ray_client(spec, num_workers, ray, storage)
        client.dispatch.park_for_sampling = park_for_sampling is not False
        return client
    return _local_client(spec, num_workers, storage, compute_thread, park_for_sampling)


def _local_client(
    spec: WorkerSpec,
    num_workers: int,
    storage: Path,
    compute_thread: ComputeThread | None,
    park_for_sampling: bool | None,
) -> LocalTrainingClient:
    """Replicas in this process: one built from the spec, the others deep copies of it."""
    first = spec.build()
    if park_for_sampling is None:
        park_for_sampling = parks_for_sampling(first.model, torch.device(spec.device))
    workers = [first] + [
        Worker(
            copy.deepcopy(first.model),
            spec.config,
            tokenizer=first.tokenizer,
            reference_factory=None if spec.head == "reference" else spec.reference_model,
        )
        for _ in range(num_workers - 1)
    ]
    return LocalTrainingClient(
        Dispatch(InProcessExecutor(workers), park_for_sampling=park_for_sampling),
        storage_dir=storage,
        base_model=spec.base_model,
        worker_factory=spec.build,
        compute_thread=compute_thread,
    )


def _ray_config(
    given: RayConfig | None,
    address: str | None,
    resources_per_worker: Mapping[str, float] | None,
) -> RayConfig:
    """`given` (or the defaults) with `address` and `resources_per_worker` applied."""
    from posttrain.engine.ray.executor import RayConfig

    ray = given or RayConfig()
    if address is not None:
        ray = replace(ray, address=address)
    if resources_per_worker is not None:
        ray = replace(ray, resources_per_worker=dict(resources_per_worker))
    return ray


def _ray_client(
    spec: WorkerSpec, num_workers: int, ray: RayConfig, storage: Path
) -> RayTrainingClient:
    from posttrain.clients.ray import RayTrainingClient
    from posttrain.engine.ray.executor import RayExecutor

    workers = RayExecutor(
        spec.build, num_workers, ray, device=spec.device, cpu_factory=spec.on_cpu().build
    )
    return RayTrainingClient(
        workers, storage_dir=storage, base_model=spec.base_model, worker_factory=spec.build
    )
