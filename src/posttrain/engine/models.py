"""Loading models and tokenizers, dtypes, and LoRA wrapping: building blocks usable alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from posttrain.engine import attention
from posttrain.engine.model_source import resolve_model_source

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


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
    A bf16/fp16 model trains its attention in float32 on the CPU (`engine.attention`: faster
    there, and more accurate).
    """
    source = resolve_model_source(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=parse_dtype(dtype), attn_implementation=attention.register()
    )
    _disable_dropout(model)
    model.eval()
    return model.to(device)  # pyright: ignore[reportArgumentType]


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model; one without a pad token pads with EOS."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(name_or_path))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass(frozen=True)
class LoraSettings:
    """LoRA (Hu et al. 2021: W = W0 + (alpha / rank) B A) with Tinker's train_* switches.

    Defaults are Tinker's: rank 32 and alpha 32, so the adapter scale alpha / rank is 1.
    """

    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("LoRA needs at least one of train_attn, train_mlp, train_unembed")

    @staticmethod
    def default_alpha(rank: int) -> float:
        """32 up to rank 32 (Tinker's fixed alpha), else `rank`, so alpha / rank stays <= 1."""
        return 32.0 if rank <= 32 else float(rank)

    def target_modules(self) -> list[str]:
        """The linear layers LoRA wraps: attention, MLP and unembedding per the flags."""
        modules: list[str] = []
        if self.train_attn:
            modules += ATTN_MODULES
        if self.train_mlp:
            modules += MLP_MODULES
        if self.train_unembed:
            modules += UNEMBED_MODULES
        return modules


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
    """
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # pyright: ignore[reportArgumentType]  # peft annotates int
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules(),
        bias="none",
        task_type="CAUSAL_LM",
        modules_to_save=modules_to_save,
    )
    if seed is None:
        return get_peft_model(model, config, autocast_adapter_dtype=True)  # type: ignore[return-value]
    # peft draws A from the default generator of the device it builds A on: the CPU, or the
    # model's own GPU(s). Fork and seed only those; reading or seeding any other GPU's
    # generator (torch.manual_seed seeds them all) would initialise CUDA for a CPU run.
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        return get_peft_model(model, config, autocast_adapter_dtype=True)  # type: ignore[return-value]
