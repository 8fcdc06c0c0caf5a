"""Typed `train()` / `train_sft()` options, defined once and composed per backend.

Each option set is a `TypedDict` (what pyright checks through `**options: Unpack[...]`) with
a frozen dataclass of the same keys holding defaults, documentation and validation. A backend
composes the sets it honours by TypedDict inheritance; an option it lacks is a pyright error
and, at run time, a `TypeError` raised by `check_options` before anything else is looked at.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, Union, get_args, get_origin, get_type_hints

from typing_extensions import TypedDict

from posttrain.algo.advantages import AdvantageEstimator, ReductionPreset
from posttrain.algo.ratios import ImportanceSamplingLevel, KLEstimator

PolicyLoss = Literal["ppo", "cispo", "importance_sampling", "dro", "gspo"]
# The policy losses whose semantics Tinker's wire protocol fixes (clip thresholds only); dro's
# masking and gspo's sequence mask are not specified there, so remote backends do not offer them.
ProtocolPolicyLoss = Literal["ppo", "cispo", "importance_sampling"]
KLMode = Literal["loss", "advantage"]
LRDecay = Literal["cosine", "linear", "constant"]
AssistantTurns = Literal["all", "last"]


class CoreRLFields(TypedDict, total=False):
    """RL options computed by the trainer or carried by Tinker's wire protocol.

    Advantages, loss reduction and mini-batching happen in the shared trainer on the caller's
    side; the clip range travels as the loss's thresholds; the rest go with `optim_step`.
    """

    learning_rate: float
    epsilon: float | None
    epsilon_high: float | None
    advantage_estimator: AdvantageEstimator
    scale_rewards: bool
    advantage_balance: float
    zero_variance_groups: Literal["drop", "keep"]
    loss_reduction: ReductionPreset
    loss_reduction_constant: float | None
    num_minibatches: int
    grad_clip: float
    weight_decay: float
    save_checkpoint: bool


# Closed TypedDicts (PEP 728): no keys beyond those declared. That is what lets pyright accept
# a backend with more options where backend-agnostic code expects `TrainableBackend`.
class RLOptions(CoreRLFields, total=False, closed=True):
    """What backend-agnostic code may pass to any backend's `train()` (TinkerBackend's set)."""

    loss: ProtocolPolicyLoss


class PosttrainLossFields(CoreRLFields, total=False):
    """Options of posttrain's own loss code, honoured wherever it runs the loss."""

    loss: PolicyLoss
    dro_beta: float
    importance_sampling_level: ImportanceSamplingLevel
    truncated_importance_sampling: float | None
    mask_prob_ratio: bool
    kimi_k2_tau: float | None
    allow_training_without_logprobs: bool


class WeightsInProcessFields(PosttrainLossFields, total=False):
    """Options that need the trainer's weights at hand (reference model, trainer logprobs)."""

    kl_penalty_coef: float
    kl_estimator: KLEstimator
    kl_mode: KLMode
    precalculate_logprobs: bool
    logprob_calculation_chunk_size: int
    plot_tensors: bool


class LocalRLOptions(WeightsInProcessFields, total=False, closed=True):
    """LocalBackend.train() options."""


class SFTOptions(TypedDict, total=False, closed=True):
    """Supervised fine-tuning options every backend honours."""

    learning_rate: float
    lr_schedule: LRDecay
    warmup_steps: int
    min_lr_ratio: float
    batch_size: int
    epochs: int
    assistant_turns: AssistantTurns
    grad_clip: float
    weight_decay: float
    shuffle_seed: int
    save_checkpoint: bool


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
        value = getattr(config, name)
        if not _accepts(annotation, value):
            raise ValueError(
                f"option {name}={value!r} is invalid: expected {_describe(annotation)}"
            )


def option_names(options_type: type) -> frozenset[str]:
    return frozenset(get_type_hints(options_type))


def check_options(options: Mapping[str, object], options_type: type, backend: str) -> None:
    """Raise TypeError for any option `backend` does not declare, suggesting the nearest."""
    known = option_names(options_type)
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"{backend}.{'train_sft' if options_type is SFTOptions else 'train'}() got an "
                f"option it does not support: {name!r}{hint} "
                f"(supported: {', '.join(sorted(known))})"
            )


def resolve_rl(options: Mapping[str, object], options_type: type, backend: str) -> RLConfig:
    check_options(options, options_type, backend)
    return RLConfig(**options)  # type: ignore[arg-type]


def resolve_sft(options: Mapping[str, object], backend: str) -> SFTConfig:
    check_options(options, SFTOptions, backend)
    return SFTConfig(**options)  # type: ignore[arg-type]


def config_field_names(config_type: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(config_type))


# One line per option, shown by `posttrain backends` and the option schemas.
HELP: dict[str, str] = {
    "learning_rate": "AdamW learning rate for this call's updates",
    "loss": "policy loss from posttrain.algo.losses",
    "epsilon": "clip range low side: ratio >= 1 - epsilon (None: the loss's default)",
    "epsilon_high": "clip range high side: ratio <= 1 + epsilon_high (None: epsilon)",
    "dro_beta": "quadratic penalty of the dro loss",
    "importance_sampling_level": "token ratios, one ratio per sequence (GSPO), or a mix",
    "advantage_estimator": "group baseline: grpo, dr_grpo (no std), rloo, maxrl",
    "scale_rewards": "divide grpo advantages by the group's reward std",
    "advantage_balance": "in [-1, 1]: >0 down-weights negative advantages, <0 positive ones",
    "zero_variance_groups": "drop or keep groups whose rewards are all equal (counted either way)",
    "loss_reduction": "token_mean (DAPO), sequence_mean (GRPO), constant (Dr. GRPO), or sum",
    "loss_reduction_constant": "normaliser for loss_reduction='constant'",
    "truncated_importance_sampling": "cap U on the trainer/sampler ratio (needs precalculate_logprobs)",
    "mask_prob_ratio": "zero the loss of tokens whose ratio leaves the clip band",
    "kimi_k2_tau": "Kimi K2's tau: advantages minus tau times the log-ratio",
    "allow_training_without_logprobs": "train trajectories without sampler logprobs (ratio 1)",
    "num_minibatches": "optimizer steps per call, each on its share of the trajectories",
    "grad_clip": "max global gradient norm (0 turns clipping off)",
    "weight_decay": "AdamW decoupled weight decay",
    "save_checkpoint": "checkpoint after the call (weights, optimizer, RNG, run_state)",
    "kl_penalty_coef": "KL penalty weight against the base model (LoRA disabled)",
    "kl_estimator": "k1 (log-ratio) or k3 (Schulman's unbiased, non-negative) estimator",
    "kl_mode": "add the KL to the loss, or shape the advantages with it (ART)",
    "precalculate_logprobs": "score the batch with the trainer's weights first; use those as the ratio's reference",
    "logprob_calculation_chunk_size": "tokens per chunk when computing logprobs (memory vs speed)",
    "plot_tensors": "save a PNG of the step's advantages, ratios and logprobs",
    "lr_schedule": "learning-rate decay after warm-up: cosine, linear or constant",
    "warmup_steps": "linear warm-up steps",
    "min_lr_ratio": "final learning rate as a fraction of the peak",
    "batch_size": "trajectories per optimizer step",
    "epochs": "passes over the trajectories",
    "assistant_turns": "train every assistant turn, or only the last",
    "shuffle_seed": "seed of the order the trajectories are visited in",
    "check_weights_in_sync": "after the step, check that every replica holds the same weights",
}
