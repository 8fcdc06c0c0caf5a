"""One base model in memory for many clients: module trees that share its weights.

A LoRA client trains its adapter and never writes the base weights, and a frozen base model
(a reference, or `posttrain serve`'s base-model sampler) writes nothing at all. So clients of
the same base need one copy of its weights between them: `SharedBases` loads a base once per
(model, dtype, device), and `model()` hands each client a module tree of its own whose
tensors are the loaded base's tensors. Each tree has its own modules (PEFT wraps them per
client), its own Parameter objects (so `requires_grad` and `.grad` stay per client), and its
own small buffers (rotary tables); the weights themselves are not copied. The tokenizer is
shared too (`tokenizer()`): at a 150k-token vocabulary it is 80 MB, four times a rank-8
adapter of a 0.5B model.

What may not share: a client that trains the base weights (full fine-tuning), whose optimizer
would write them in place under every other client. `create_training_client` refuses it.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.load import load_hf_model, load_tokenizer, parse_dtype


class SharedBases:
    """Base models by (name, dtype, device), each loaded once, on first use; thread-safe."""

    def __init__(self) -> None:
        self._bases: dict[tuple[str, torch.dtype, torch.device], PreTrainedModel] = {}
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}
        self._lock = threading.Lock()

    def model(
        self, name_or_path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
    ) -> PreTrainedModel:
        """A module tree of its own over the one loaded copy of the base's weights."""
        key = (str(name_or_path), parse_dtype(dtype), torch.device(device))
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                base = load_hf_model(name_or_path, dtype=dtype, device=device)
                self._bases[key] = base
        return sharing_copy(base)

    def tokenizer(self, name_or_path: str | Path) -> PreTrainedTokenizerBase:
        """The base's tokenizer, loaded once: a 150k-token vocabulary holds about 80 MB."""
        with self._lock:
            tokenizer = self._tokenizers.get(str(name_or_path))
            if tokenizer is None:
                tokenizer = load_tokenizer(name_or_path)
                self._tokenizers[str(name_or_path)] = tokenizer
        return tokenizer

    def loaded(self) -> list[PreTrainedModel]:
        """The bases loaded so far (the originals, which no client holds)."""
        with self._lock:
            return list(self._bases.values())


def sharing_copy(model: PreTrainedModel) -> PreTrainedModel:
    """`model`'s module tree again, with new Parameters over the same tensors.

    Parameters that are one object in `model` (tied embeddings) are one object in the copy.
    Buffers are copied: they are small, and a module may rewrite one in place (rotary tables).
    """
    memo: dict[int, object] = {}
    for param in model.parameters():  # each Parameter once, tied ones included
        memo[id(param)] = nn.Parameter(param.detach(), requires_grad=param.requires_grad)
    return copy.deepcopy(model, memo)


def shares_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether every frozen weight of `a` is a tensor that `b` holds too (the same memory):
    true of two clients of one `SharedBases` base, whatever wraps them (PEFT renames)."""
    held = {p.data_ptr() for p in b.parameters()}
    frozen = [p for p in a.parameters() if not p.requires_grad]
    return bool(frozen) and all(p.data_ptr() in held for p in frozen)
