"""Sync what changed: each step's trainable tensors as a small update over the base model,
for an engine in a worker process that started on the base model itself.

Trainer side, `UpdateExporter` writes version N into `directory/vN` (in /dev/shm): a LoRA run's
adapter on linear layers as a PEFT adapter directory (`adapter/`, the "adapter" route: vLLM
loads it under a new name), and every other trained tensor, raw, in `tensors.safetensors`: an
adapter on `lm_head` or the embedding (which vLLM cannot carry), full-fine-tuning tensors, or
on the "merge" route the whole adapter. Nothing frozen travels, nothing is merged here.

Worker side, `resolve_update` turns such an update into whole tensors under Hugging Face names,
each LoRA pair merged as W0 + (alpha / rank) * B @ A against W0 read from the base model's
safetensors, memory-mapped; the engine then writes them into its weights in place.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from posttrain.inference.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    split_adapter,
    write_adapter,
)
from posttrain.inference.protocol import WeightSnapshot
from posttrain.inference.weights import (
    lora_pairs,
    merge_pair,
    new_version_directory,
    publish_version,
)
from posttrain.models.file_modes import save_tensors
from posttrain.models.lora import LoraSettings

TENSORS = "tensors.safetensors"
# How a LoRA run's adapter reaches the engine: loaded as a LoRA ("adapter"), or merged into
# the engine's weights in place ("merge").
LoraRoute = Literal["adapter", "merge"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UpdateExporter:
    """Writes each version's update into `directory/v<version>`, keeping the newest `keep`
    (an engine may still be loading one of them)."""

    def __init__(
        self,
        directory: Path,
        *,
        base_model: str,
        lora: LoraSettings | None,
        route: LoraRoute,
        dtype: str,
        keep: int = 3,
    ) -> None:
        self.directory = directory
        self.base_model = base_model
        self.lora = lora
        self.route = route
        self.dtype = _DTYPES[dtype]
        self.keep = max(keep, 1)
        self._written: list[Path] = []

    @property
    def lora_scale(self) -> float | None:
        return None if self.lora is None else self.lora.alpha / self.lora.rank

    def export(self, trainable: Mapping[str, torch.Tensor], version: int) -> WeightSnapshot:
        tmp = new_version_directory(self.directory)
        rest: Mapping[str, torch.Tensor] = trainable
        adapter = False
        if self.lora is not None and self.route == "adapter":
            split = split_adapter(trainable)
            if split.adapter:
                write_adapter(
                    split,
                    tmp / "adapter",
                    rank=self.lora.rank,
                    alpha=self.lora.alpha,
                    base_model=self.base_model,
                    dtype=self.dtype,
                )
                adapter = True
                rest = split.other
        if rest:
            # LoRA factors stay as trained (merged in float32 by the engine); whole tensors
            # travel in the engine's precision, which is what it keeps of them anyway.
            pairs, _ = lora_pairs(rest)
            tensors = {
                name: (t if _is_factor(name, pairs) else t.to(self.dtype)).detach().cpu()
                for name, t in rest.items()
            }
            save_tensors({k: v.contiguous() for k, v in tensors.items()}, tmp / TENSORS)
        final = publish_version(tmp, self.directory / f"v{version}", self._written, self.keep)
        return WeightSnapshot(
            final,
            version,
            kind="update",
            adapter=final / "adapter" if adapter else None,
            tensors=final / TENSORS if rest else None,
            lora_scale=self.lora_scale,
            bytes=sum(f.stat().st_size for f in final.rglob("*") if f.is_file()),
        )

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _is_factor(name: str, pairs: Mapping[str, object]) -> bool:
    return any(f"{layer}.lora_" in name for layer in pairs)


class BaseWeights:
    """The base model's tensors by name, read on demand from its safetensors files
    (memory-mapped; nothing is read until asked for)."""

    def __init__(self, model_dir: Path) -> None:
        self._where: dict[str, Path] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                self._where.update(dict.fromkeys(handle.keys(), file))
        if not self._where:
            raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
        self.tied = bool(
            json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
        )

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (memory-mapped, then copied out per tensor)."""
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def resolve_update(
    base: BaseWeights,
    *,
    adapter: Path | None,
    tensors: Path | None,
    lora_scale: float | None,
    merge_adapter: bool,
) -> dict[str, torch.Tensor]:
    """Whole tensors (Hugging Face names) to write into an engine's weights for an update:
    `tensors`' plain tensors as they are and its LoRA pairs merged against the base weight,
    and with `merge_adapter` the PEFT adapter's pairs too (else the engine loads it as a LoRA)."""
    raw = read_tensors(tensors) if tensors is not None else {}
    pairs, plain = lora_pairs(raw)
    scales = dict.fromkeys(pairs, lora_scale)
    if adapter is not None and merge_adapter:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text())
        adapted, _ = lora_pairs(read_tensors(adapter / ADAPTER_WEIGHTS))
        pairs |= adapted
        scales |= dict.fromkeys(adapted, float(config["lora_alpha"]) / int(config["r"]))
    out = dict(plain)
    for layer, pair in pairs.items():
        scale = scales[layer]
        if scale is None:
            raise ValueError(f"the update holds a LoRA pair for {layer!r} but no lora_scale")
        key = f"{layer}.weight"
        if key not in base and key not in out:
            if layer == "lm_head" and base.tied:
                raise ValueError(
                    "an adapter on lm_head alone of a model whose lm_head is its input "
                    "embedding (tie_word_embeddings) cannot be merged in place; train the "
                    "unembedding as an embedding adapter (posttrain's default) instead"
                )
            raise KeyError(f"LoRA layer {layer!r} has no base weight {key!r} in the base model")
        w0 = out[key] if key in out else base.get(key)
        out[key] = merge_pair(w0.float(), pair, scale)
    return out
