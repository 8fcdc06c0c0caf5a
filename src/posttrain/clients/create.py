"""`create_training_client`: one call that assembles a ready LocalTrainingClient."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.dispatch import Dispatch, InProcessExecutor
from posttrain.engine.models import LoraSettings, apply_lora, load_hf_model, load_tokenizer
from posttrain.engine.worker import Worker, WorkerConfig


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
) -> LocalTrainingClient:
    """Load `base_model` (a local directory or hub id), optionally wrap it with LoRA, and return
    a client over `num_workers` in-process data-parallel replicas.

    `lora_rank=None` trains all weights. Replicas start bit-identical (copies of one model).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    torch.manual_seed(seed)  # LoRA's A matrices are drawn from torch's generator
    model = load_hf_model(base_model, dtype=dtype, device=device)
    tokenizer = load_tokenizer(base_model)
    if lora_rank is not None:
        settings = LoraSettings(
            rank=lora_rank,
            alpha=lora_alpha if lora_alpha is not None else LoraSettings.default_alpha(lora_rank),
            train_attn=train_attn,
            train_mlp=train_mlp,
            train_unembed=train_unembed,
        )
        model = apply_lora(model, settings)

    def reference() -> torch.nn.Module:
        return load_hf_model(base_model, dtype=dtype, device=device)

    config = WorkerConfig(
        micro_batch_tokens=micro_batch_tokens, logprob_chunk_size=logprob_chunk_size, device=device
    )
    replicas = [model] + [copy.deepcopy(model) for _ in range(num_workers - 1)]
    workers = [
        Worker(m, config, tokenizer=tokenizer, reference_factory=reference) for m in replicas
    ]
    storage = Path(storage_dir) if storage_dir else Path(tempfile.mkdtemp(prefix="posttrain-"))
    return LocalTrainingClient(
        Dispatch(InProcessExecutor(workers)), storage_dir=storage, base_model=str(base_model)
    )
