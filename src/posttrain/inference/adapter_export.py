"""`AdapterExporter`: the model's LoRA at each version as a PEFT adapter directory, for an
engine that loads adapters by path (a vLLM server's `/v1/load_lora_adapter`).

Each export gets a directory of its own, never reused: vLLM may read an adapter's files again
while it serves it (its worker evicts adapters from a bounded cache and reloads them by path),
so the engine that loaded one deletes it (`discard`) once it no longer serves it.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from posttrain.inference.adapters import (
    AdapterSplit,
    lora_sync_problem,
    split_adapter,
    write_adapter,
)
from posttrain.inference.protocol import WeightSnapshot
from posttrain.models.lora import LoraSettings


class AdapterExporter:
    """Writes version `v`'s adapter into `directory/v<v>` (a fresh name if taken)."""

    def __init__(self, base_model: str, directory: Path, *, lora: LoraSettings) -> None:
        self.base_model = base_model
        self.directory = directory
        self.rank, self.alpha = lora.rank, lora.alpha

    def export(self, trainable: Mapping[str, torch.Tensor], version: int) -> WeightSnapshot:
        """Write version `version`'s adapter; refused for what an adapter cannot carry."""
        split = split_adapter(trainable)
        check_carried(split)
        final = self.directory / f"v{version}"
        if final.exists():  # a re-sync of the same step (after a failed one): a new name
            final = self.directory / f"v{version}-{uuid.uuid4().hex[:8]}"
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        write_adapter(split, tmp, rank=self.rank, alpha=self.alpha, base_model=self.base_model)
        tmp.rename(final)  # whole or absent: the server never reads a half-written adapter
        size = sum(f.stat().st_size for f in final.iterdir())
        scale = self.alpha / self.rank
        return WeightSnapshot(
            final, version, kind="update", adapter=final, lora_scale=scale, bytes=size
        )

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def check_carried(split: AdapterSplit) -> None:
    """Refuse trained tensors a vLLM adapter cannot carry, naming the fix (`lora_sync_problem`)."""
    problem = lora_sync_problem(split.adapted, split.whole)
    if problem is not None:
        raise ValueError(problem)


def discard(snapshot_path: Path) -> None:
    """Delete an adapter directory the engine no longer serves."""
    shutil.rmtree(snapshot_path, ignore_errors=True)
