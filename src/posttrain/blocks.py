"""Building blocks for power users, each usable alone, under the names of the rollouts
handoff (seed 004), so code written against those names ports by changing its imports.

- models: `parse_dtype`, `compute_device_map_single_gpu`, `load_hf_model`;
- optimization: `create_adamw_optimizer` (a model or its parameters),
  `create_warmup_cosine_scheduler` (warm-up, then cosine, linear or constant decay to
  `min_lr_ratio`: `engine.optim.lr_multiplier`, the schedule SFT uses);
- loss: `create_cross_entropy_loss`, a logits-level callable with `loss_mask`;
- training clients: `create_pytorch_backend` (one call: `clients.create.create_training_client`
  with the optimizer settings kept on the client) and `create_backend_with_scheduler` (the same,
  whose `optim_step` follows a schedule). Despite the handoff's names these return training
  clients (Tinker's primitives), not posttrain backends (`train()`);
- `JSONLLogger`: one JSON object a line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel

from posttrain.algo.logprobs import token_logprobs
from posttrain.clients.create import create_training_client
from posttrain.clients.scheduled import ScheduledTrainingClient
from posttrain.engine.devices import AUTO, resolve_device
from posttrain.engine.optim import Decay, lr_multiplier
from posttrain.engine.optim import create_adamw_optimizer as _adamw
from posttrain.models import load as models
from posttrain.models.load import parse_dtype
from posttrain.types import AdamParams

__all__ = [
    "JSONLLogger",
    "ScheduledTrainingClient",
    "compute_device_map_single_gpu",
    "create_adamw_optimizer",
    "create_backend_with_scheduler",
    "create_cross_entropy_loss",
    "create_pytorch_backend",
    "create_warmup_cosine_scheduler",
    "load_hf_model",
    "parse_dtype",
]

DeviceType = Literal["auto", "cpu", "cuda"]
DeviceMap = Mapping[str, int]
IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def compute_device_map_single_gpu(
    device_type: Literal["cpu", "cuda"], gpu_rank: int
) -> dict[str, int] | None:
    """The device map that puts a whole model on GPU `gpu_rank` ({"": rank}), or None on the CPU."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if isinstance(gpu_rank, bool) or not isinstance(gpu_rank, int) or gpu_rank < 0:
        raise ValueError(f"gpu_rank must be an int >= 0, got {gpu_rank!r}")
    return {"": gpu_rank} if device_type == "cuda" else None


def load_hf_model(
    model_name: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | DeviceMap | None = "cpu",
) -> PreTrainedModel:
    """`models.load.load_hf_model` (dropout off, eval mode, SDPA), also taking the device map
    `compute_device_map_single_gpu` gives: {"": rank} is that GPU, None the CPU."""
    if device is None:
        device = "cpu"
    elif not isinstance(device, str):
        if set(device) != {""}:
            raise ValueError(
                f"device map {dict(device)!r} is not supported: give {{'': gpu_rank}} (the whole "
                "model on one GPU), a device string such as 'cuda:0', or None for the CPU"
            )
        device = f"cuda:{device['']}"
    return models.load_hf_model(model_name, dtype, resolve_device(device, option="device"))


def create_adamw_optimizer(
    model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter],
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-12,
    weight_decay: float = 0.0,
) -> torch.optim.AdamW:
    """`engine.optim.create_adamw_optimizer` over a model's trainable parameters (those with
    requires_grad: a LoRA model's adapters) or over the parameters given."""
    if isinstance(model_or_params, torch.nn.Module):
        params = [p for p in model_or_params.parameters() if p.requires_grad]
    else:
        params = list(model_or_params)
    return _adamw(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def create_warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.1,
    decay: Decay = "cosine",
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `engine.optim.lr_multiplier` (call `.step()` after each optimizer step):
    linear warm-up (k + 1) / num_warmup_steps, then `decay` from the base rate down to
    `min_lr_ratio` of it at `num_training_steps` (0.1 by default, the handoff's)."""
    schedule = partial(
        lr_multiplier,
        warmup_steps=num_warmup_steps,
        total_steps=num_training_steps,
        decay=decay,
        min_lr_ratio=min_lr_ratio,
    )
    schedule(0)  # a bad argument fails here, naming it
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


CrossEntropyLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


def create_cross_entropy_loss(
    reduction: Literal["mean", "sum"] = "mean", *, chunk_size: int = 1024
) -> CrossEntropyLoss:
    """`loss_fn(logits_BTV, batch)`: cross-entropy of `batch["labels"]` [B, T] (aligned with
    the logits' positions; -100 means no loss) under `batch["loss_mask"]` [B, T] weights if
    given, averaged over the masked-in tokens ("mean") or summed ("sum", posttrain's
    convention: invariant to how a batch is split). Log-probabilities come from
    `algo.logprobs.token_logprobs`, in float32 chunks of `chunk_size` tokens."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")

    def cross_entropy_loss(
        logits_BTV: torch.Tensor, batch: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        if "labels" not in batch:
            raise ValueError(f"batch needs 'labels' [B, T]; it has {sorted(batch)}")
        labels_BT = batch["labels"]
        mask_BT = batch.get("loss_mask")
        mask_BT = (
            torch.ones_like(labels_BT, dtype=torch.float32) if mask_BT is None else mask_BT.float()
        )
        if mask_BT.shape != labels_BT.shape:
            raise ValueError(
                f"loss_mask {tuple(mask_BT.shape)} must have the labels' shape {tuple(labels_BT.shape)}"
            )
        ignored_BT = labels_BT == IGNORE_INDEX
        mask_BT = mask_BT.masked_fill(ignored_BT, 0.0)
        logp_BT, _ = token_logprobs(
            logits_BTV, labels_BT.masked_fill(ignored_BT, 0), chunk_size=chunk_size
        )
        total = -(logp_BT * mask_BT).sum()
        return total if reduction == "sum" else total / mask_BT.sum().clamp(min=1.0)

    return cross_entropy_loss


def create_pytorch_backend(
    model_name: str | Path,
    checkpoint_dir: str | Path | None = None,
    *,
    device_type: DeviceType = AUTO,
    dtype: str = "float32",
    gpu_rank: int = 0,
    learning_rate: float = 1e-4,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    lora_rank: int | None = None,
    seed: int = 0,
) -> ScheduledTrainingClient:
    """A local training client on `model_name` (a directory or hub id) in one call, keeping
    its checkpoints in `checkpoint_dir` (created; a temporary directory if None) and applying
    `learning_rate`, `adam_betas` and `weight_decay` at each `optim_step()`. `device_type`
    "auto" is CUDA where there is CUDA, else the CPU; on CUDA the model goes to `gpu_rank`.
    `lora_rank=None` trains all weights."""
    return create_backend_with_scheduler(
        model_name,
        checkpoint_dir,
        num_training_steps=None,
        device_type=device_type,
        dtype=dtype,
        gpu_rank=gpu_rank,
        learning_rate=learning_rate,
        adam_betas=adam_betas,
        weight_decay=weight_decay,
        lora_rank=lora_rank,
        seed=seed,
    )


def create_backend_with_scheduler(
    model_name: str | Path,
    checkpoint_dir: str | Path | None = None,
    *,
    num_training_steps: int | None,
    warmup_ratio: float = 0.03,
    decay: Decay = "cosine",
    min_lr_ratio: float = 0.1,
    device_type: DeviceType = AUTO,
    dtype: str = "float32",
    gpu_rank: int = 0,
    learning_rate: float = 1e-4,
    adam_betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.0,
    lora_rank: int | None = None,
    seed: int = 0,
) -> ScheduledTrainingClient:
    """`create_pytorch_backend` whose `optim_step()` follows `create_warmup_cosine_scheduler`'s
    schedule over `num_training_steps`, with max(1, int(num_training_steps * warmup_ratio))
    warm-up steps (the handoff's rule); None: a constant rate."""
    if device_type not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device_type must be 'auto', 'cpu' or 'cuda', got {device_type!r}")
    compute_device_map_single_gpu("cpu", gpu_rank)  # checks gpu_rank
    device = resolve_device(device_type, option="device_type")
    if device == "cuda":
        device = resolve_device(f"cuda:{gpu_rank}", option="gpu_rank")
    schedule = None
    if num_training_steps is not None:
        if not 0.0 <= warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1], got {warmup_ratio}")
        schedule = partial(
            lr_multiplier,
            warmup_steps=max(1, int(num_training_steps * warmup_ratio)),
            total_steps=num_training_steps,
            decay=decay,
            min_lr_ratio=min_lr_ratio,
        )
        schedule(0)  # a bad argument fails here, before the model loads
    adam = AdamParams(
        learning_rate=learning_rate,
        beta1=adam_betas[0],
        beta2=adam_betas[1],
        weight_decay=weight_decay,
    )
    storage = None
    if checkpoint_dir is not None:
        storage = Path(checkpoint_dir)
        storage.mkdir(parents=True, exist_ok=True)
    client = create_training_client(
        model_name, lora_rank=lora_rank, device=device, dtype=dtype, storage_dir=storage, seed=seed
    )
    return ScheduledTrainingClient(client, adam, schedule)


class JSONLLogger:
    """Append-only JSON Lines: one object a line, each written through at once, so the file
    can be read (and survives a crash) while the run goes on. Tensor and numpy scalars are
    written as numbers. Also a `logging_sinks.Sink` (`write(split, step, metrics)`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def log(self, metrics: Mapping[str, object], step: int | None = None) -> None:
        """Append `metrics`, with `"step": step` first when given."""
        if step is not None and "step" in metrics:
            raise ValueError("metrics has a 'step' key and step= was given: pass one of them")
        row = {"step": step, **metrics} if step is not None else dict(metrics)
        self._file.write(json.dumps(row, default=_plain) + "\n")

    def write(self, split: str, step: int, metrics: Mapping[str, float]) -> None:
        self.log({"split": split, **metrics}, step=step)

    def read(self) -> list[dict[str, object]]:
        """Every row written so far."""
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JSONLLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: object) -> object:
    """A 0-d tensor or numpy scalar as its Python number; a path as text."""
    if isinstance(value, Path):
        return str(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    raise TypeError(
        f"{type(value).__name__} {value!r} is not JSON: log numbers, strings, bools, lists or dicts"
    )
