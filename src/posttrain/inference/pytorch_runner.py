"""posttrain's own sampler inside the engine worker process (`host.py`): split mode.

The same `Sampler` as in the training process, so a seed samples the same tokens from the
same weights, on its own device and thread budget. It starts on the base model; each sync's
update (`updates.py`) is merged into its weights in place, the adapter too: no whole-model file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from posttrain.engine.decode.sampler import Sampler
from posttrain.inference.updates import BaseWeights, resolve_update
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.types import SamplingParams


class PytorchRunner:
    def __init__(self, options: dict[str, Any]) -> None:
        model_dir = options["model_dir"]
        model = load_hf_model(model_dir, dtype=options["dtype"], device=options["device"])
        self.sampler = Sampler(model, load_tokenizer(model_dir))
        self.base = BaseWeights(Path(model_dir))

    def sample(self, request: dict[str, Any]) -> list[list[dict[str, Any]]]:
        params = SamplingParams(**request["params"])
        responses = self.sampler.sample(request["prompts"], request["n"], params)
        return [
            [
                {
                    "tokens": s.tokens,
                    "logprobs": s.logprobs,
                    "stop_reason": s.stop_reason,
                    "entropies": s.entropies,
                }
                for s in response.sequences
            ]
            for response in responses
        ]

    def load(self, path: str) -> None:
        weights = load_file(str(Path(path) / "model.safetensors"))
        model = self.sampler.model
        device = next(model.parameters()).device
        with torch.no_grad():
            model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=True)

    def update(self, request: dict[str, Any]) -> list[str]:
        """Lay an update over the base weights, in place: W = W0 + s B A for each LoRA pair
        (the adapter's included), other trained tensors copied."""
        if request["kind"] == "model":
            self.load(request["path"])
            return []
        tensors = resolve_update(
            self.base,
            adapter=_path(request.get("adapter")),
            tensors=_path(request.get("tensors")),
            lora_scale=request.get("lora_scale"),
            merge_adapter=True,
        )
        params = dict(self.sampler.model.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"the update names tensors the model does not have: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
        return []  # no adapter is held: each is merged


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)
