"""Loading models and tokenizers, dtypes, and LoRA wrapping: building blocks usable alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """"float32" | "bfloat16" | "float16" (or a torch.dtype among them) to a torch.dtype."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise ValueError(f"dtype {name} is not supported; use one of {', '.join(DTYPES)}")
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}") from None


def _check_source(name_or_path: str | Path) -> str:
    text = str(name_or_path)
    path = Path(text).expanduser()
    looks_local = path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: it is not a saved model directory")
        return str(path)
    if looks_local:
        raise FileNotFoundError(f"base model path {text} does not exist")
    return text  # a hub id such as "Qwen/Qwen3-0.6B"


def load_hf_model(
    name_or_path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> PreTrainedModel:
    """A transformers causal LM from a local directory or hub id, on `device`, in `dtype`."""
    source = _check_source(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=parse_dtype(dtype), attn_implementation="sdpa"
    )
    return model.to(device)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(_check_source(name_or_path))


@dataclass(frozen=True)
class LoraSettings:
    """LoRA (Hu et al. 2021) on the chosen parts, with Tinker's train_* switches."""

    rank: int
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
        return 32.0 if rank <= 32 else float(rank)

    def target_modules(self) -> list[str]:
        modules: list[str] = []
        if self.train_attn:
            modules += ATTN_MODULES
        if self.train_mlp:
            modules += MLP_MODULES
        if self.train_unembed:
            modules += UNEMBED_MODULES
        return modules


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Wrap `model` with LoRA adapters; only the adapters train."""
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules(),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)  # type: ignore[return-value]
