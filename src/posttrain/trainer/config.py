"""Resolved `train()` / `train_sft()` configuration: frozen dataclasses with their defaults.

The trainer reads these; `backends.options` defines the typed keyword options that resolve to
them, so the trainer never imports a backend module.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Literal, Union, get_args, get_origin, get_type_hints

from posttrain.algo.advantages import AdvantageEstimator, ReductionPreset
from posttrain.algo.ratios import ImportanceSamplingLevel, KLEstimator

PolicyLoss = Literal["ppo", "cispo", "importance_sampling", "dro", "gspo"]
# The policy losses whose semantics Tinker's wire protocol fixes (clip thresholds only); dro's
# masking and gspo's sequence mask are not specified there, so remote backends do not offer them.
ProtocolPolicyLoss = Literal["ppo", "cispo", "importance_sampling"]
KLMode = Literal["loss", "advantage"]
LRDecay = Literal["cosine", "linear", "constant"]
AssistantTurns = Literal["all", "last"]


@dataclass(frozen=True)
class RLConfig:
    """Resolved RL options with their defaults (keys are those of `LocalRLOptions`)."""

    learning_rate: float = 1e-5  # AdamW peak learning rate for this step
    loss: PolicyLoss = "ppo"  # policy loss from algo.losses
    epsilon: float | None = None  # clip range 1 - epsilon (None: the loss's default)
    epsilon_high: float | None = None  # clip range 1 + epsilon_high (None: epsilon)
    dro_beta: float = 0.05  # dro's quadratic penalty
    importance_sampling_level: ImportanceSamplingLevel = "token"
    advantage_estimator: AdvantageEstimator = "grpo"
    scale_rewards: bool = True  # divide group advantages by the group's std (grpo)
    advantage_balance: float = 0.0  # in [-1, 1]: down-weight one sign of advantage
    zero_variance_groups: Literal["drop", "keep"] = "drop"
    loss_reduction: ReductionPreset = "token_mean"
    loss_reduction_constant: float | None = None  # needed by loss_reduction="constant"
    truncated_importance_sampling: float | None = None  # cap on trainer/sampler ratio
    mask_prob_ratio: bool = False  # drop tokens whose ratio leaves the clip band
    kimi_k2_tau: float | None = None
    allow_training_without_logprobs: bool = False  # missing sampler logprobs mean ratio 1
    num_minibatches: int = 1  # optimizer steps per call
    grad_clip: float = 1.0  # max global grad norm (0: off)
    weight_decay: float = 0.0
    save_checkpoint: bool = True
    kl_penalty_coef: float = 0.0  # KL to the base model (LoRA disabled)
    kl_estimator: KLEstimator = "k3"
    kl_mode: KLMode = "loss"
    precalculate_logprobs: bool = False  # trainer logprobs as the ratio's reference
    logprob_calculation_chunk_size: int = 1024
    plot_tensors: bool = False  # PNG plots of advantages, ratios and logprobs per step

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {self.num_minibatches}")
        if not -1.0 <= self.advantage_balance <= 1.0:
            raise ValueError(f"advantage_balance must be in [-1, 1], got {self.advantage_balance}")
        if self.loss_reduction == "constant" and not (self.loss_reduction_constant or 0) > 0:
            raise ValueError("loss_reduction='constant' needs loss_reduction_constant > 0")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if self.kl_penalty_coef < 0:
            raise ValueError(f"kl_penalty_coef must be >= 0, got {self.kl_penalty_coef}")
        if self.logprob_calculation_chunk_size < 1:
            raise ValueError("logprob_calculation_chunk_size must be >= 1")


@dataclass(frozen=True)
class SFTConfig:
    """Resolved SFT options with their defaults (keys are those of `SFTOptions`)."""

    learning_rate: float = 1e-4  # peak learning rate of the schedule
    lr_schedule: LRDecay = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    batch_size: int = 8  # trajectories per optimizer step
    epochs: int = 1
    assistant_turns: AssistantTurns = "all"  # train every assistant turn, or the last only
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    shuffle_seed: int = 0
    save_checkpoint: bool = True

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")


def _accepts(annotation: object, value: object) -> bool:
    origin = get_origin(annotation)
    if origin is Literal:
        return value in get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(_accepts(arg, value) for arg in get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _describe(annotation: object) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def check_field_types(config: object) -> None:
    """Runtime check of each field against its annotation (Literal choices included)."""
    for name, annotation in get_type_hints(type(config)).items():
        check_value(name, annotation, getattr(config, name))


def check_value(name: str, annotation: object, value: object) -> None:
    """Raise ValueError unless `value` fits `annotation` (Literal choices included)."""
    if not _accepts(annotation, value):
        raise ValueError(f"option {name}={value!r} is invalid: expected {_describe(annotation)}")
