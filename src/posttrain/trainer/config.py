"""Resolved `train()` / `train_sft()` configuration: frozen dataclasses nested by concern.

Each option is defined once, as a field with its default, help and range
(`algo.config_fields.option`): the advantage options in `algo.advantages.AdvantageConfig`, the
loss options in `algo.losses.LossConfig`, the optimizer's in `OptimizerConfig`, and the rest
here. The flat keyword options of `train()` are the fields' keys (`from_options` builds a config
from them); `backends.options` declares the typed option sets that resolve to these, so the
trainer never imports a backend module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from posttrain.algo.advantages import AdvantageConfig
from posttrain.algo.config_fields import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Check,
    check_field_types,
    check_fields,
    check_value,
    from_options,
    group,
    is_config,
    option,
    option_defaults,
    option_fields,
    option_help,
    option_values,
    with_options,
)
from posttrain.algo.dpo import PairLoss
from posttrain.algo.losses import KLMode, LossConfig, with_art_clip_defaults
from posttrain.clients.custom_loss import (
    LossName,
    is_custom_loss,
    is_pair_loss,
    policy_loss_names,
)
from posttrain.clients.teacher import Teacher
from posttrain.finder import did_you_mean
from posttrain.types import AdamParams

__all__ = [
    "AssistantTurns",
    "DPOConfig",
    "DPOReference",
    "DistillConfig",
    "KLMode",
    "LRDecay",
    "LossName",
    "OptimizerConfig",
    "PairLoss",
    "PolicyLoss",
    "ProtocolPolicyLoss",
    "RLConfig",
    "SFTConfig",
    "check_field_types",
    "check_value",
    "from_options",
    "is_config",
    "option_defaults",
    "option_fields",
    "option_help",
    "option_values",
    "with_options",
]

PolicyLoss = Literal["ppo", "cispo", "importance_sampling", "dro", "gspo"]
# The policy losses whose semantics Tinker's wire protocol fixes (clip thresholds only); dro's
# masking and gspo's sequence mask are not specified there, so remote backends do not offer them.
ProtocolPolicyLoss = Literal["ppo", "cispo", "importance_sampling"]
LRDecay = Literal["cosine", "linear", "constant"]
AssistantTurns = Literal["all", "last"]
DEFAULT_LOSS: PolicyLoss = "cispo"  # ART's, when neither loss nor ppo is given
# The reference of a DPO call: the base model (LoRA off, or a frozen base model), or the policy
# as it is at the start of the call (the SFT model, when DPO follows SFT).
DPOReference = Literal["base", "initial"]


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings of a call's updates (betas and eps keep `AdamParams`' defaults)."""

    learning_rate: float = option(1e-5, "AdamW learning rate for this call's updates", NON_NEGATIVE)
    # Infinity means nothing for any float option: "no clipping" is 0, "no cap" is None.
    grad_clip: float = option(
        1.0,
        "max global gradient norm (0 turns clipping off)",
        Check("a finite number >= 0 (0 turns clipping off)", NON_NEGATIVE.ok),
    )
    weight_decay: float = option(0.0, "AdamW decoupled weight decay", NON_NEGATIVE)

    def __post_init__(self) -> None:
        check_fields(self)

    def adam_params(self, learning_rate: float | None = None) -> AdamParams:
        """These settings as `optim_step`'s parameters, at `learning_rate` if given (a schedule's)."""
        return AdamParams(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            weight_decay=self.weight_decay,
            grad_clip_norm=self.grad_clip,
        )


def _unit_interval(v: float) -> bool:
    return 0.0 <= v <= 1.0


@dataclass(frozen=True)
class CriticConfig:
    """PPO with a learned value function: GAE and the critic's updates (advantage_estimator
    'gae', on backends with a critic). verl's defaults for γ and λ (1.0: undiscounted returns,
    Monte-Carlo advantages minus the critic's baseline); the value clip of OpenRLHF (0.2)."""

    gae_gamma: float = option(1.0, "GAE discount gamma", Check("in [0, 1]", _unit_interval))
    gae_lambda: float = option(
        1.0,
        "GAE lambda (1: Monte-Carlo, 0: one-step TD)",
        Check("in [0, 1]", _unit_interval),
    )
    value_clip: float | None = option(
        0.2,
        "critic values move at most this far from their pre-step values (PPO2's clipped value "
        "loss); None: unclipped",
        POSITIVE,
    )
    critic_learning_rate: float | None = option(
        None,
        "the critic's AdamW learning rate (None: the policy's learning_rate)",
        NON_NEGATIVE,
    )

    def __post_init__(self) -> None:
        check_fields(self)


def check_loss_name(name: str | None) -> None:
    """A built-in policy loss or a registered custom one; else a ValueError naming the nearest."""
    problem = loss_name_problem(name)
    if problem is not None:
        raise ValueError(problem)


def loss_name_problem(
    name: str | None, builtins: Sequence[str] = get_args(PolicyLoss)
) -> str | None:
    """Why `train(loss=name)` is refused where `builtins` are the built-in losses that run, or
    None: it is one of them or a registered custom policy loss. The message lists only those."""
    if name is None or name in builtins or (is_custom_loss(name) and not is_pair_loss(name)):
        return None
    if is_pair_loss(name):
        return (
            f"option loss={name!r} is a loss of preference pairs, which train_dpo runs (its "
            "own loss option); train() takes a policy loss"
        )
    names = [*builtins, *policy_loss_names()]
    return (
        f"option loss={name!r} is invalid: expected one of {', '.join(map(repr, names))}, a "
        f"custom loss registered with register_loss or the 'posttrain.losses' entry point "
        f"group, or a dotted path 'package.module:function'{did_you_mean(name, names)}"
    )


def _false(value: float) -> bool:
    return value is False


def save_checkpoint_option() -> bool:
    """The `save_checkpoint` option of both calls."""
    return option(True, "checkpoint after the call (weights, optimizer, RNG, run_state)")


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (`algo.distill`): the teacher, and how much task reward to mix in."""

    teacher: Teacher | None = option(
        None,
        "on-policy distillation: a posttrain Teacher that scores the student's sampled tokens; "
        "each token's advantage becomes teacher - student logprob, every group trains, and "
        "teacher_kl (the reverse-KL estimate) is reported",
    )
    distill_reward_coef: float = option(
        0.0,
        "with a teacher: weight of the task-reward advantage added to each token's teacher - "
        "student advantage (0: pure distillation)",
        NON_NEGATIVE,
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RLConfig:
    """Resolved RL options with their defaults (keys are those of `LocalRLOptions`).

    Named as Tinker's `forward_backward(data, loss_fn, loss_fn_config)`: `loss_fn` is the policy
    loss (the flat option `loss`), `loss_fn_config` its configuration. The aliases are resolved
    once, when the config is built, so readers read only the canonical fields: `ppo` becomes
    `loss_fn`, ART's clip range fills the unset `epsilon` / `epsilon_high` of ppo and cispo, and
    `algorithm_mode` becomes `advantage_estimator` and `token_transform` (`AdvantageConfig`).
    The alias fields keep what was given, for messages that name the option the user wrote.
    """

    optimizer: OptimizerConfig = group(OptimizerConfig)
    loss_fn: PolicyLoss | LossName = option(
        DEFAULT_LOSS,
        "policy loss from posttrain.algo.losses (default 'cispo' as in ART, 'ppo' when ppo=True), "
        "or a registered custom loss's LossName; unset clip ranges take ART's: ppo epsilon 0.2, "
        "cispo epsilon 1.0 and epsilon_high 4.0",
        Check("a loss name (a string)", lambda v: isinstance(v, str)),
        key="loss",
    )
    ppo: bool | None = option(
        None,
        "ART's switch: True means loss='ppo', False loss='cispo' (a conflicting loss is an error)",
    )
    loss_fn_config: LossConfig = group(LossConfig)
    advantages: AdvantageConfig = group(AdvantageConfig)
    distill: DistillConfig = group(DistillConfig)
    num_minibatches: int = option(
        1, "optimizer steps per call, each on its share of the trajectories", AT_LEAST_ONE
    )
    update_epochs: int = option(
        1,
        "passes over the batch's mini-batches (num_minibatches x update_epochs updates)",
        AT_LEAST_ONE,
    )
    critic: CriticConfig = group(CriticConfig)
    precalculate_logprobs: bool = option(
        False,
        "score the batch with the trainer's weights first; use those as the ratio's reference",
    )
    logprob_calculation_chunk_size: int = option(
        1024, "tokens per chunk when computing logprobs (memory vs speed)", AT_LEAST_ONE
    )
    save_checkpoint: bool = save_checkpoint_option()
    plot_tensors: bool = option(False, "save a PNG of the step's advantages, ratios and logprobs")
    verbose: bool = option(False, "log each update's loss, tokens and metrics (step diagnostics)")
    # ART 0.4's fit of the reward std dev over the run's history; ART 0.5 ignores the option.
    # Refused rather than accepted and ignored: a script that relies on it must know.
    scale_learning_rate_by_reward_std_dev: bool = option(
        False,
        "not supported (ART 0.5 ignores it too): True is an error; scale learning_rate yourself",
        Check("False (posttrain does not scale the learning rate by the reward std dev)", _false),
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.ppo is not None:
            implied = "ppo" if self.ppo else "cispo"
            # A loss at its default cannot be told from one left out here; `check_given`
            # refuses an explicit loss='cispo' with ppo=True when the options are read.
            if self.loss_fn not in (implied, DEFAULT_LOSS):
                raise _ppo_conflict(self.loss_fn, self.ppo)
            object.__setattr__(self, "loss_fn", implied)
        check_loss_name(self.loss_fn)
        config = with_art_clip_defaults(self.loss_fn, self.loss_fn_config)
        object.__setattr__(self, "loss_fn_config", config)

    @staticmethod
    def check_given(options: Mapping[str, object]) -> None:
        """The conflict `__post_init__` cannot see: an explicit `loss` that `ppo` contradicts."""
        loss, ppo = options.get("loss"), options.get("ppo")
        if loss is not None and isinstance(ppo, bool) and loss != ("ppo" if ppo else "cispo"):
            raise _ppo_conflict(loss, ppo)


def _ppo_conflict(loss: object, ppo: bool) -> ValueError:
    implied = "ppo" if ppo else "cispo"
    return ValueError(
        f"options loss={loss!r} and ppo={ppo} disagree (ppo={ppo} means loss={implied!r}): "
        "pass only one of them"
    )


@dataclass(frozen=True)
class SFTConfig:
    """Resolved SFT options with their defaults (keys are those of `LocalSFTOptions`)."""

    optimizer: OptimizerConfig = group(lambda: OptimizerConfig(learning_rate=1e-4))
    lr_schedule: LRDecay = option(
        "cosine", "learning-rate decay after warm-up: cosine, linear or constant"
    )
    warmup_steps: int = option(0, "linear warm-up steps", Check(">= 0", lambda v: v >= 0))
    min_lr_ratio: float = option(
        0.0,
        "final learning rate as a fraction of the peak",
        Check("in [0, 1]", lambda v: 0 <= v <= 1),
    )
    batch_size: int = option(8, "trajectories per optimizer step", AT_LEAST_ONE)
    epochs: int = option(1, "passes over the trajectories", AT_LEAST_ONE)
    packing: bool = option(
        False,
        "pack trajectories end to end into rows, each attending only to itself, instead of "
        "padding each to its micro-batch's longest (LocalBackend, RayBackend)",
    )
    assistant_turns: AssistantTurns = option("all", "train every assistant turn, or only the last")
    shuffle_seed: int = option(0, "seed of the order the trajectories are visited in")
    save_checkpoint: bool = save_checkpoint_option()

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DPOConfig:
    """Resolved DPO options with their defaults (keys are those of `DPOOptions`)."""

    optimizer: OptimizerConfig = group(OptimizerConfig)
    beta: float = option(
        0.1, "DPO's beta: the inverse temperature of the implicit reward", POSITIVE
    )
    loss_fn: PairLoss = option(
        "sigmoid",
        "'sigmoid' (DPO) on summed logprobs, or 'ipo' (IPO) on per-token averaged logprobs",
        key="loss",
    )
    reference: DPOReference = option(
        "base",
        "reference policy: 'base' (the base model: LoRA off, or a frozen base model) or 'initial' "
        "(the policy at the start of the call)",
    )
    batch_size: int = option(8, "preference pairs per optimizer step", AT_LEAST_ONE)
    epochs: int = option(1, "passes over the pairs", AT_LEAST_ONE)
    shuffle_seed: int = option(0, "seed of the order the pairs are visited in")
    save_checkpoint: bool = save_checkpoint_option()

    def __post_init__(self) -> None:
        check_fields(self)
