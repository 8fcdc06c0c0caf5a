"""Typed `train()` / `train_sft()` / `train_dpo()` options, composed per backend.

Each option is defined once, as a field of the nested config in `trainer.config` (default, help,
range). Each option set here is a `TypedDict` naming some of those fields' flat keys: what
pyright checks through `**options: Unpack[...]`, so they stay written out, one line per option,
and tests/backends/test_options.py asserts that they list exactly the configs' keys with the
same types. A backend composes the sets it honours by TypedDict inheritance; an option it lacks
is a pyright error and, at run time, a `TypeError` raised by `check_options` before anything
else is looked at. `HELP` and each set's documentation are derived from the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_type_hints

from typing_extensions import TypedDict

from posttrain.algo.advantages import (
    AdvantageEstimator,
    AlgorithmMode,
    GroupEstimator,
    ReductionPreset,
)
from posttrain.algo.ratios import ImportanceSamplingLevel, KLEstimator
from posttrain.algo.sepa import SEPASchedule
from posttrain.algo.token_transforms import TokenTransform
from posttrain.clients.teacher import Teacher
from posttrain.finder import did_you_mean
from posttrain.trainer.config import (
    AssistantTurns,
    DPOConfig,
    DPOReference,
    KLMode,
    LossName,
    LRDecay,
    PairLoss,
    PolicyLoss,
    ProtocolPolicyLoss,
    RLConfig,
    SFTConfig,
    from_options,
    option_help,
)


class CoreRLFields(TypedDict, total=False):
    """RL options computed by the trainer or carried by Tinker's wire protocol.

    Advantages (per token too: token transforms, SEPA, a teacher's distillation), loss
    reduction and mini-batching happen in the shared trainer on the caller's side (the teacher
    is called from there); per-token advantages travel in the datums; the clip range travels as the loss's thresholds; the rest go with `optim_step`.
    """

    learning_rate: float
    ppo: bool | None
    epsilon: float | None
    epsilon_high: float | None
    scale_rewards: bool
    advantage_balance: float
    zero_variance_groups: Literal["drop", "keep"]
    loss_reduction: ReductionPreset
    loss_reduction_constant: float | None
    algorithm_mode: AlgorithmMode | None
    token_transform: TokenTransform
    uncertainty_kind: str
    gtpo_beta: float
    hicra_alpha: float
    entropy_mask_rho: float
    strategic_grams: str | None
    sepa_schedule: SEPASchedule
    sepa_steps: int
    sepa_delay_steps: int
    sepa_correct_rate_gate: float
    sepa_warmup_steps: int
    sepa_ema_decay: float
    teacher: Teacher | None
    distill_reward_coef: float
    num_minibatches: int
    update_epochs: int
    grad_clip: float
    weight_decay: float
    save_checkpoint: bool
    verbose: bool
    scale_learning_rate_by_reward_std_dev: bool


# Closed TypedDicts (PEP 728): no keys beyond those declared. That is what lets pyright accept
# a backend with more options where backend-agnostic code expects `TrainableBackend`.
class RLOptions(CoreRLFields, total=False, closed=True):
    """What backend-agnostic code may pass to any backend's `train()`."""

    loss: ProtocolPolicyLoss | LossName
    advantage_estimator: GroupEstimator  # 'gae' needs a critic: CriticFields


class PosttrainLossFields(CoreRLFields, total=False):
    """Options of posttrain's own loss code, honoured wherever it runs the loss."""

    loss: PolicyLoss | LossName
    dro_beta: float
    importance_sampling_level: ImportanceSamplingLevel
    truncated_importance_sampling: float | None
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float | None
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


class CriticFields(WeightsInProcessFields, total=False):
    """Options of PPO with a learned critic (advantage_estimator='gae'): backends whose models
    get a value model beside the policy (`supports_critic`)."""

    advantage_estimator: AdvantageEstimator
    gae_gamma: float
    gae_lambda: float
    value_clip: float | None
    critic_learning_rate: float | None


class LocalRLOptions(CriticFields, total=False, closed=True):
    """LocalBackend.train() options."""


class SFTFields(TypedDict, total=False):
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


class SFTOptions(SFTFields, total=False, closed=True):
    """What backend-agnostic code may pass to any backend's `train_sft()`; TinkerBackend's
    options (Tinker's wire protocol carries datums, not how the server lays them out)."""


class LocalSFTOptions(SFTFields, total=False, closed=True):
    """LocalBackend.train_sft() and RayBackend.train_sft() options: their engine packs."""

    packing: bool


class DPOFields(TypedDict, total=False):
    """DPO options every backend honours."""

    learning_rate: float
    beta: float
    loss: PairLoss
    batch_size: int
    epochs: int
    grad_clip: float
    weight_decay: float
    shuffle_seed: int
    save_checkpoint: bool


class DPOOptions(DPOFields, total=False, closed=True):
    """DPO options of the backends whose client scores with the base model (Local, Ray)."""

    reference: DPOReference


class RemoteDPOOptions(DPOFields, total=False, closed=True):
    """TinkerBackend.train_dpo() options: its reference is the policy at the start of the call
    (the Tinker protocol cannot score with the base model)."""


def option_names(options_type: type) -> frozenset[str]:
    return frozenset(get_type_hints(options_type))


def check_options(
    options: Mapping[str, object], options_type: type, backend: str, call: str | None = None
) -> None:
    """Raise TypeError for any option `backend`'s `call` (train or train_sft unless given) does
    not declare, suggesting the nearest."""
    known = option_names(options_type)
    call = call or ("train_sft" if options_type in (SFTOptions, LocalSFTOptions) else "train")
    for name in options:
        if name not in known:
            raise TypeError(
                f"{backend}.{call}() got an "
                f"option it does not support: {name!r}{did_you_mean(name, known)} "
                f"(supported: {', '.join(sorted(known))})"
            )


def resolve_rl(options: Mapping[str, object], options_type: type, backend: str) -> RLConfig:
    check_options(options, options_type, backend)
    return from_options(RLConfig, options)


def resolve_sft(options: Mapping[str, object], options_type: type, backend: str) -> SFTConfig:
    check_options(options, options_type, backend, "train_sft")
    return from_options(SFTConfig, options)


def resolve_dpo(options: Mapping[str, object], options_type: type, backend: str) -> DPOConfig:
    check_options(options, options_type, backend, "train_dpo")
    return from_options(DPOConfig, options)


# One line per option, shown by `posttrain backends` and the option schemas: the fields' help.
HELP: dict[str, str] = {**option_help(RLConfig), **option_help(SFTConfig)}


def document(options_type: type, config_type: type) -> None:
    """Append each option's help line, from `config_type`'s fields, to the set's docstring."""
    described = option_help(config_type)
    lines = [f"    {key}: {described[key]}" for key in sorted(option_names(options_type))]
    options_type.__doc__ = f"{options_type.__doc__ or ''}\n\nOptions:\n" + "\n".join(lines)


document(CoreRLFields, RLConfig)
document(RLOptions, RLConfig)
document(PosttrainLossFields, RLConfig)
document(WeightsInProcessFields, RLConfig)
document(CriticFields, RLConfig)
document(LocalRLOptions, RLConfig)
document(SFTFields, SFTConfig)
document(SFTOptions, SFTConfig)
document(LocalSFTOptions, SFTConfig)
document(DPOOptions, DPOConfig)
document(RemoteDPOOptions, DPOConfig)
