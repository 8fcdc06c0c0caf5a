"""The one LoRA spec (`LoraSettings`) and its default rank; no torch, so the records that hold
one (`TrainableModel`, the job's `[model]`) import it cheaply. `models.load` applies it."""

from __future__ import annotations

from dataclasses import dataclass

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
# A linear-attention layer's projections (Qwen3.5's GatedDeltaNet: query/key/value, output
# gate, decay and update gates, output), adapted with attention on a model that has them.
LINEAR_ATTN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")


def has_linear_attention(model_config: object) -> bool:
    """Whether a transformers config (object or dict) has linear-attention layers."""
    if isinstance(model_config, dict):
        layers = model_config.get("layer_types")
    else:
        layers = getattr(model_config, "layer_types", None)
    return isinstance(layers, list | tuple) and "linear_attention" in layers


# The one default LoRA rank, Tinker's (`create_lora_training_client(rank=32)`): of the spec
# below, `TrainableModel`, the job's `[model] lora_rank` and `create_training_client`.
DEFAULT_LORA_RANK = 32


@dataclass(frozen=True)
class LoraSettings:
    """LoRA (Hu et al. 2021: W = W0 + (alpha / rank) B A) with Tinker's train_* switches: the
    one LoRA spec, which `TrainableModel`, the job's `[model]` and `create_training_client`
    build from their flat fields with `LoraSettings.of`.

    Defaults are Tinker's: rank 32 and alpha 32, so the adapter scale alpha / rank is 1.

    `train_unembed`: True adapts the unembedding; on a model that ties it to the input
    embedding that is one LoRA on the shared matrix, which both the embedding lookup and the
    output projection then see (`apply_lora`). None, the default, adapts the unembedding where
    it is a matrix of its own and leaves a tied one as it is, so that the adapter holds no
    embedding-sized factor and PEFT's own merge reproduces it (docs/backends.md, "LoRA").
    """

    rank: int = DEFAULT_LORA_RANK
    alpha: float = 32.0
    dropout: float = 0.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not (self.train_attn or self.train_mlp or self.train_unembed is not False):
            raise ValueError("LoRA needs at least one of train_attn, train_mlp, train_unembed")

    @classmethod
    def of(
        cls,
        rank: int | None,
        alpha: float | None = None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool | None = None,
    ) -> LoraSettings | None:
        """The spec of the flat fields every entry point takes: None (full fine-tuning) for
        rank None or 0 (the TOML spelling); alpha None is `default_alpha(rank)`."""
        if not rank:
            return None
        alpha = alpha if alpha is not None else cls.default_alpha(rank)
        return cls(rank, alpha, 0.0, train_attn, train_mlp, train_unembed)

    @staticmethod
    def default_alpha(rank: int) -> float:
        """32 up to rank 32 (Tinker's fixed alpha), else `rank`, so alpha / rank stays <= 1."""
        return 32.0 if rank <= 32 else float(rank)

    def adapts_unembedding(self, tied: bool) -> bool:
        """Whether the unembedding gets an adapter, on a model that ties it (`tied`) or not."""
        return (not tied) if self.train_unembed is None else self.train_unembed

    def target_modules(self, tied: bool = False, linear_attention: bool = False) -> list[str]:
        """The linear layers LoRA wraps: attention (with a linear-attention layer's
        projections, on a model that has them), MLP and unembedding per the flags."""
        modules: list[str] = []
        if self.train_attn:
            modules += ATTN_MODULES
            if linear_attention:
                modules += LINEAR_ATTN_MODULES
        if self.train_mlp:
            modules += MLP_MODULES
        if self.adapts_unembedding(tied):
            modules += UNEMBED_MODULES
        return modules
