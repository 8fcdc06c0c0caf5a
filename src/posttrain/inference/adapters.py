"""A training client's LoRA as a PEFT adapter directory, for engines that load adapters (vLLM
offline, a vLLM server's `/v1/load_lora_adapter`), and what such an engine cannot carry.

vLLM's LoRA adapts linear layers only: an adapter on `lm_head` or on the input embedding (a
tied model's unembedding adapter) is refused on Qwen2 and Llama. `split_adapter` keeps those
apart, with any trained tensor that is not a LoRA factor, so the caller can send them another
way (merged, in place).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.engine.file_modes import save_tensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# A linear layer's factor, in memory (`.lora_A.default.weight`) or as PEFT saves it.
_LINEAR = re.compile(r"^(?P<layer>.+)\.lora_(?P<which>[AB])(\.[^.]+)?\.weight$")
# Layers vLLM's LoRA cannot carry: the unembedding and the input embedding.
_UNCARRIED = ("lm_head", "embed_tokens")


@dataclass(frozen=True)
class AdapterSplit:
    """`adapter`: LoRA factors of linear layers vLLM can load, under PEFT's saved names
    (`base_model.model.<layer>.lora_A.weight`); `other`: every other trained tensor under
    its in-memory name (an unembedding or embedding adapter, full-fine-tuning tensors);
    `target_modules`: the adapted module names (`q_proj`, ...)."""

    adapter: dict[str, torch.Tensor]
    other: dict[str, torch.Tensor]
    target_modules: list[str]

    @property
    def adapter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.adapter.values())


def split_adapter(trainable: Mapping[str, torch.Tensor]) -> AdapterSplit:
    """Split a client's trainable tensors (`ExportsWeights.trainable_weights`) into what a
    vLLM adapter carries and the rest."""
    adapter: dict[str, torch.Tensor] = {}
    other: dict[str, torch.Tensor] = {}
    modules: set[str] = set()
    for name, tensor in trainable.items():
        match = _LINEAR.match(name.removeprefix(PEFT_PREFIX))
        if match is None or match["layer"].split(".")[-1] in _UNCARRIED:
            other[name] = tensor
            continue
        layer = match["layer"]
        adapter[f"{PEFT_PREFIX}{layer}.lora_{match['which']}.weight"] = tensor
        modules.add(layer.split(".")[-1])
    return AdapterSplit(adapter, other, sorted(modules))


def write_adapter(
    split: AdapterSplit,
    directory: Path,
    *,
    rank: int,
    alpha: float,
    base_model: str,
    dtype: torch.dtype | None = None,
) -> int:
    """`split.adapter` as a PEFT adapter in `directory` (made if missing): its config and
    `adapter_model.safetensors`, cast to `dtype` if given. Returns the bytes of the tensors."""
    if not split.adapter:
        raise ValueError("the trainable weights hold no LoRA factor of a linear layer")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
        for k, v in split.adapter.items()
    }
    save_tensors(tensors, directory / ADAPTER_WEIGHTS, {"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": split.target_modules,
        "base_model_name_or_path": base_model,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return sum(t.numel() * t.element_size() for t in tensors.values())
