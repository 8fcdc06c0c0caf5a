"""Resolved `train()` / `train_sft()` configuration: frozen dataclasses with their defaults.

The trainer reads these; `backends.options` defines the typed keyword options that resolve to
them, so the trainer never imports a backend module.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
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

# Infinity means nothing for any float option: "no clipping" is 0, "no cap" is None.
FINITE_CLIP = "a finite number >= 0 (0 turns clipping off)"


@dataclass(frozen=True)
class RLConfig:
    """Resolved RL options with their defaults (keys are those of `LocalRLOptions`)."""

    learning_rate: float = 1e-5  # AdamW peak learning rate for this step
    loss: PolicyLoss | None = None  # policy loss from algo.losses (None: see `policy_loss`)
    ppo: bool | None = None  # ART's switch: True is loss "ppo", False is "cispo"
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

    @property
    def policy_loss(self) -> PolicyLoss:
        """`loss` if given, else what `ppo` asks for; "ppo" when neither is set."""
        if self.loss is not None:
            return self.loss
        return "cispo" if self.ppo is False else "ppo"

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.loss is not None and self.ppo is not None:
            implied = "ppo" if self.ppo else "cispo"
            if self.loss != implied:
                raise ValueError(
                    f"options loss={self.loss!r} and ppo={self.ppo} disagree (ppo={self.ppo} "
                    f"means loss={implied!r}): pass only one of them"
                )
        check_range(self, "learning_rate", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        check_range(
            self, "epsilon", "in [0, 1] (the clip floor is 1 - epsilon)", lambda v: 0 <= v <= 1
        )
        check_range(
            self,
            "epsilon_high",
            "a finite number >= 0 (the clip ceiling is 1 + epsilon_high)",
            lambda v: 0 <= v < math.inf,
        )
        check_range(self, "dro_beta", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        check_range(self, "advantage_balance", "in [-1, 1]", lambda v: -1 <= v <= 1)
        check_range(
            self, "loss_reduction_constant", "a finite number > 0", lambda v: 0 < v < math.inf
        )
        if self.loss_reduction == "constant" and self.loss_reduction_constant is None:
            raise ValueError(
                "option loss_reduction_constant is needed by loss_reduction='constant': "
                "pass loss_reduction_constant > 0"
            )
        check_range(
            self,
            "truncated_importance_sampling",
            "a finite cap > 0 (None: no cap)",
            lambda v: 0 < v < math.inf,
        )
        check_range(self, "kimi_k2_tau", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        check_range(self, "num_minibatches", ">= 1", lambda v: v >= 1)
        check_range(self, "grad_clip", FINITE_CLIP, lambda v: 0 <= v < math.inf)
        check_range(self, "weight_decay", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        check_range(self, "kl_penalty_coef", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        check_range(self, "logprob_calculation_chunk_size", ">= 1", lambda v: v >= 1)


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
        check_range(self, "learning_rate", "a finite number >= 0", lambda v: 0 <= v < math.inf)
        check_range(self, "warmup_steps", ">= 0", lambda v: v >= 0)
        check_range(self, "min_lr_ratio", "in [0, 1]", lambda v: 0 <= v <= 1)
        check_range(self, "batch_size", ">= 1", lambda v: v >= 1)
        check_range(self, "epochs", ">= 1", lambda v: v >= 1)
        check_range(self, "grad_clip", FINITE_CLIP, lambda v: 0 <= v < math.inf)
        check_range(self, "weight_decay", "a finite number >= 0", lambda v: 0 <= v < math.inf)


def check_range(config: object, name: str, expected: str, ok: Callable[[float], bool]) -> None:
    """Raise ValueError naming option `name` unless its value (if not None) passes `ok`.

    `ok` is False for NaN whatever the bound, since every comparison with NaN is.
    """
    value = getattr(config, name)
    if value is not None and not ok(value):
        raise ValueError(f"option {name}={value!r} is invalid: expected {expected}")


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
