"""Typed `train()` / `train_sft()` options, defined once and composed per backend.

Each option set is a `TypedDict` (what pyright checks through `**options: Unpack[...]`) with
a frozen dataclass of the same keys in `trainer.config` holding defaults and validation. A backend
composes the sets it honours by TypedDict inheritance; an option it lacks is a pyright error
and, at run time, a `TypeError` raised by `check_options` before anything else is looked at.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from typing import Literal, get_type_hints

from typing_extensions import TypedDict

from posttrain.algo.advantages import AdvantageEstimator, ReductionPreset
from posttrain.algo.ratios import ImportanceSamplingLevel, KLEstimator
from posttrain.trainer.config import (
    AssistantTurns,
    KLMode,
    LRDecay,
    PolicyLoss,
    ProtocolPolicyLoss,
    RLConfig,
    SFTConfig,
)


class CoreRLFields(TypedDict, total=False):
    """RL options computed by the trainer or carried by Tinker's wire protocol.

    Advantages, loss reduction and mini-batching happen in the shared trainer on the caller's
    side; the clip range travels as the loss's thresholds; the rest go with `optim_step`.
    """

    learning_rate: float
    ppo: bool | None
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
    "loss": "policy loss from posttrain.algo.losses (default 'ppo', or 'cispo' when ppo=False)",
    "ppo": "ART's switch: True means loss='ppo', False loss='cispo' (a conflicting loss is an error)",
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
