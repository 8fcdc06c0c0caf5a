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
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.models.file_modes import save_tensors
from posttrain.models.lora import LoraSettings, has_linear_attention

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# A linear layer's factor, in memory (`.lora_A.default.weight`) or as PEFT saves it.
_LINEAR = re.compile(r"^(?P<layer>.+)\.lora_(?P<which>[AB])(\.[^.]+)?\.weight$")
# Any LoRA factor: a linear layer's, or an embedding's (`.lora_embedding_A.default`).
_FACTOR = re.compile(r"^(?P<layer>.+)\.lora_(embedding_)?[AB](\.[^.]+)?(\.weight)?$")
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

    @property
    def adapted(self) -> list[str]:
        """Every layer the LoRA adapts, by last name, carried or not (`lm_head`, ...)."""
        found = (_FACTOR.match(name.removeprefix(PEFT_PREFIX)) for name in self.other)
        uncarried = {m["layer"].split(".")[-1] for m in found if m is not None}
        return sorted({*self.target_modules, *uncarried})

    @property
    def whole(self) -> list[str]:
        """The trained tensors that are no LoRA factor: trained whole (full fine-tuning)."""
        return sorted(n for n in self.other if not _FACTOR.match(n.removeprefix(PEFT_PREFIX)))


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


def lora_sync_problem(adapted: Collection[str], whole: Collection[str] = ()) -> str | None:
    """Why `[inference] sync = 'lora'` cannot send what a model trains as a vLLM LoRA adapter,
    or None. `adapted`: the layers its LoRA adapts, by last name (`q_proj`, `lm_head`);
    `whole`: the tensors it trains whole. The one rule: register asks it of the model's
    trained weights (`check_carried`), and job preflight and `posttrain explain` of the job's
    LoRA before anything loads (`planned_layers`)."""
    if not adapted:
        return (
            "[inference] sync = 'lora' sends the model's LoRA adapter, and this model trains "
            "no LoRA of a linear layer (full fine-tuning): set sync = 'reload' (whole weights)"
        )
    uncarried = [f"an adapter on {layer}" for layer in sorted(set(adapted) & set(_UNCARRIED))]
    if whole:
        more = f" and {len(whole) - 4} more" if len(whole) > 4 else ""
        uncarried.append(f"{', '.join(sorted(whole)[:4])}{more} trained whole")
    if not uncarried:
        return None
    return (
        f"[inference] sync = 'lora': vLLM's LoRA cannot carry what this model trains: "
        f"{' and '.join(uncarried)} (it adapts linear layers only, not the unembedding or the "
        "embedding); train LoRA with train_unembed = false (attention and MLP layers only), "
        "or set sync = 'reload' (whole LoRA-merged weights)"
    )


def planned_layers(lora: LoraSettings | None, model_config: Mapping[str, object]) -> list[str]:
    """The layers `lora` will adapt on the model of this transformers config (as a dict),
    named as `split_adapter` finds them: a tied unembedding's adapter is the embedding's."""
    if lora is None:
        return []
    tied = model_config.get("tie_word_embeddings") is True
    layers = lora.target_modules(tied, has_linear_attention(dict(model_config)))
    return sorted("embed_tokens" if tied and layer == "lm_head" else layer for layer in layers)


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
