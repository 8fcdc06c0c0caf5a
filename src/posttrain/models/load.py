"""Loading models and tokenizers, dtypes, and LoRA wrapping: building blocks usable alone."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.models import attention
from posttrain.models.families import unverified_warning
from posttrain.models.lora import LoraSettings, has_linear_attention
from posttrain.models.source import resolve_model_source

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if not isinstance(base, nn.Module):
        raise TypeError(
            f"expected a torch module inside {type(model).__name__}, got {type(base).__name__}"
        )
    return base


def lm_part(
    lm: nn.Module, accessor: Literal["get_decoder", "get_input_embeddings", "get_output_embeddings"]
) -> nn.Module:
    """`lm.get_decoder()` and its kin: transformers' accessors, which nn.Module's stubs lack."""
    part = getattr(lm, accessor)()
    if not isinstance(part, nn.Module):
        raise TypeError(
            f"{type(lm).__name__}.{accessor}() returned {type(part).__name__}, not a torch module"
        )
    return part


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """ "float32" | "bfloat16" | "float16" (or a torch.dtype among them) to a torch.dtype."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ValueError(f"dtype {name} is not supported; use one of {', '.join(DTYPES)}")
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}"
        ) from None


def check_trainable_dtype(dtype: str | torch.dtype, lora: bool) -> None:
    """Full fine-tuning trains float32 weights only: AdamW's update of a bf16 weight (lr 1e-5 on
    a weight of 0.02 moves it 2e-7, under bf16's step of 2^-8 relative, 8e-5) rounds to zero."""
    if not lora and parse_dtype(dtype) != torch.float32:
        raise ValueError(
            f"full fine-tuning in {dtype} would round most updates away (no float32 master "
            "weights); train LoRA (adapters stay float32 on a half-precision base) or use "
            "dtype='float32'"
        )


def _disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout rate, so training logprobs equal sampling logprobs even in train mode."""
    # Attention layers copy their rate from the config into a float attribute at construction
    # (e.g. Qwen2Attention.attention_dropout), so zero those as well as nn.Dropout modules.
    holders: list[object] = [*model.modules(), getattr(model, "config", None)]
    for holder in holders:
        if isinstance(holder, torch.nn.Dropout):
            holder.p = 0.0
        for key, value in vars(holder).items() if holder is not None else ():
            if "dropout" in key and isinstance(value, float):
                setattr(holder, key, 0.0)


def load_hf_model(
    name_or_path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> PreTrainedModel:
    """A transformers causal LM from a local directory, hub id, .gguf file or packaged model
    (`model_source.resolve_model_source`), on `device`, in `dtype`.

    Dropout is zeroed and the model is in eval mode. Attention is SDPA: on CPU it matches or beats
    eager attention on the 30M-parameter `small` tiny model and never materialises a [T, T] matrix.
    A bf16/fp16 model trains its attention in float32 on the CPU (`models.attention`: faster
    there, and more accurate). A model of a family posttrain has not checked
    (`models.families`) loads with a one-line warning, once per family and process.
    """
    source = resolve_model_source(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=parse_dtype(dtype), attn_implementation=attention.register()
    )
    _warn_unverified(model.config)
    _disable_dropout(model)
    model.eval()
    return model.to(device)  # pyright: ignore[reportArgumentType]


_WARNED: set[str] = set()  # model types warned about in this process


def _warn_unverified(config: object) -> None:
    warning = unverified_warning(config)
    model_type = str(getattr(config, "model_type", ""))
    if warning is not None and model_type not in _WARNED:
        _WARNED.add(model_type)
        log.warning("%s", warning)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model; one without a pad token pads with EOS."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(name_or_path))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def ties_embeddings(model: nn.Module) -> bool:
    """Whether the model's output projection is its input embedding: one shared Parameter
    (`tie_word_embeddings`, as SmolLM2, Qwen2.5-0.5B and Llama-3.2-1B publish it)."""
    get_output = getattr(model, "get_output_embeddings", None)
    get_input = getattr(model, "get_input_embeddings", None)
    if not (callable(get_output) and callable(get_input)):
        return False
    output, embedding = get_output(), get_input()
    weight = getattr(output, "weight", None)
    return weight is not None and weight is getattr(embedding, "weight", None)


def apply_lora(
    model: PreTrainedModel,
    settings: LoraSettings,
    *,
    seed: int | None = None,
    modules_to_save: list[str] | None = None,
) -> PeftModel:
    """Wrap `model` with LoRA adapters; only the adapters (and `modules_to_save`, trained and
    saved whole: a critic's value head) train.

    B starts at zero, so the wrapped model computes what `model` does. Adapters are float32
    whatever the base dtype: on a bf16 base, an update far below bf16's resolution (2^-8
    relative) still changes them. The random A matrices
    come from torch's global generator, or from `seed` without touching that generator (nor
    any GPU's: a model on the CPU never initialises CUDA).

    On a tied model with `train_unembed=True` the adapter is PEFT's `ensure_weight_tying` one:
    a LoRA on the input embedding whose factors the output projection uses transposed
    (`_share_tied_factors`).
    """
    tied = ties_embeddings(model)
    targets = settings.target_modules(tied, has_linear_attention(getattr(model, "config", None)))
    if not targets:
        raise ValueError(
            "LoRA would adapt no layer: train_attn and train_mlp are False and this model ties "
            "its unembedding to the input embedding, which train_unembed=None leaves alone; "
            "set train_unembed=True to adapt the shared embedding matrix, or train_attn / "
            "train_mlp"
        )
    tie_adapter = tied and settings.adapts_unembedding(tied)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # pyright: ignore[reportArgumentType]  # peft annotates int
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        modules_to_save=modules_to_save,
        ensure_weight_tying=tie_adapter,
    )
    if seed is None:
        wrapped = _get_peft_model(model, config)
    else:
        # peft draws A from the default generator of the device it builds A on: the CPU, or the
        # model's own GPU(s). Fork and seed only those; reading or seeding any other GPU's
        # generator (torch.manual_seed seeds them all) would initialise CUDA for a CPU run.
        devices = sorted(
            {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}
        )
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.random.default_generator.manual_seed(seed)
            for index in devices:
                torch.cuda.default_generators[index].manual_seed(seed)
            wrapped = _get_peft_model(model, config)
    if tie_adapter:
        _share_tied_factors(wrapped)
    return wrapped


def _get_peft_model(model: PreTrainedModel, config: LoraConfig) -> PeftModel:
    with warnings.catch_warnings():
        # PEFT reads transformers' renamed `is_gradient_checkpointing`; nothing a caller can
        # change, and transformers repeats it for every adapter built.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        return get_peft_model(model, config, autocast_adapter_dtype=True)


class _TransposedFactor(nn.Module):
    """A LoRA factor of the tied output projection: the transpose of the embedding adapter's
    factor, read from that one Parameter at every use."""

    def __init__(self, embedding: nn.Module, table: str, adapter: str) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the Parameter belongs to the embedding alone.
        object.__setattr__(self, "embedding", embedding)
        self.table = table
        self.adapter = adapter

    @property
    def weight(self) -> torch.Tensor:
        tables: nn.ParameterDict = getattr(self.__dict__["embedding"], self.table)
        return tables[self.adapter].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        # Saved as PEFT saves its own tied factors (a copy beside the embedding's), so that
        # `PeftModel.from_pretrained` finds every key it expects.
        weight = self.weight
        destination[prefix + "weight"] = weight if keep_vars else weight.detach()

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        pass  # the values arrive with the embedding's own keys


def _share_tied_factors(model: PeftModel) -> None:
    """Make the tied output projection use the embedding adapter's Parameters themselves.

    PEFT 0.21's `ensure_weight_tying` gives lm_head's LoRA two Parameters of its own that only
    share storage with the embedding's (B^T, A^T): each gets its own gradient and AdamW moments,
    so two optimizer updates would land on one tensor. As views of the embedding's factors
    there is one Parameter per factor, whose gradient sums both uses.
    """
    lm = model.get_base_model()
    head: Any = lm_part(lm, "get_output_embeddings")
    embedding = lm_part(lm, "get_input_embeddings")
    for adapter in model.peft_config:
        if adapter not in getattr(head, "lora_A", {}) or adapter not in getattr(
            embedding, "lora_embedding_A", {}
        ):
            raise ValueError(
                f"PEFT did not tie the unembedding's LoRA to the embedding's for adapter "
                f"{adapter!r}; use train_unembed=None (the tied matrix stays as it is)"
            )
        head.lora_A[adapter] = _TransposedFactor(embedding, "lora_embedding_B", adapter)
        head.lora_B[adapter] = _TransposedFactor(embedding, "lora_embedding_A", adapter)
