"""What the losses of `algo.losses` are configured and fed with, importing no other loss module:
`LossConfig` (each option with the losses it applies to) and `LossBatch` (one micro-batch's
per-token tensors), the tables of which inputs and clip bounds each loss has, and the reading
of Tinker's `loss_fn_config` into a LossConfig (`LossConfig.from_mapping`; the other way is
`algo.loss_wire`).

Tinker names two things differently from posttrain's options: the clip range travels as
absolute ratio bounds (clip_low_threshold = 1 - epsilon, clip_high_threshold = 1 + epsilon_high)
and dro's penalty as `beta` (dro_beta). Every other key is LossConfig's own field name. Both
directions are exact for the thresholds that matter: 1 - x is exact for a bound x in [0.5, 2]
(Sterbenz), and x - 1 for any x >= 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from posttrain.algo.config_fields import (
    NON_NEGATIVE,
    POSITIVE,
    Check,
    ConfigValue,
    check_fields,
    option,
    read_optional_number,
    reject_unknown_keys,
)
from posttrain.algo.ratios import ImportanceSamplingLevel, KLEstimator

# Absolute ratio bounds (lo, hi) per loss when the config leaves them None: Tinker's documented
# defaults for ppo and cispo; the GSPO paper's clip ranges 3e-4 / 4e-4 around 1 for gspo (a
# sequence ratio is a per-token geometric mean, so it stays far closer to 1 than token ratios);
# importance_sampling never clips and uses its bounds only as mask_prob_ratio's band.
DEFAULT_THRESHOLDS: dict[str, tuple[float, float]] = {
    "importance_sampling": (0.8, 1.2),
    "ppo": (0.8, 1.2),
    "cispo": (0.0, 4.0),
    "gspo": (1 - 3e-4, 1 + 4e-4),
}
RATIO_LOSSES = tuple(DEFAULT_THRESHOLDS)

_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _POLICY_INPUTS,
    "ppo": _POLICY_INPUTS,
    "cispo": _POLICY_INPUTS,
    "dro": _POLICY_INPUTS,
    "gspo": _POLICY_INPUTS,
    "value": ("target_tokens", "returns"),  # a critic's (`algo.value_loss`)
}
THRESHOLD_KEYS = ("clip_low_threshold", "clip_high_threshold")
CLIP_KEYS = ("epsilon", "epsilon_high")  # LossConfig's clip range
# Every loss_fn_input a loss reads, one value per token: each must have logp_BT's [B, T] shape
# exactly. Broadcasting would silently give a [B, 1] advantage to every token of its row, and a
# [B, T+1] input (one value per token of the whole sequence rather than per target) would fail
# inside torch with a message that names no key. Other keys pass through unchecked.
PER_TOKEN_INPUTS = (
    "target_tokens",
    "weights",
    "advantages",
    "logprobs",
    "mask",
    "sampler_logprobs",
    "ref_logprobs",
    "sequence_ratio_mask",
    *THRESHOLD_KEYS,
    *("returns", "old_values", "value_clip"),
)


# ART's clip range per loss as (epsilon, epsilon_high), epsilon_high None meaning epsilon: the
# trainer's defaults, so an ART script ports unchanged. Tinker's protocol defaults (the losses'
# own, `DEFAULT_THRESHOLDS`) differ for cispo: its high bound is 4.0 there, 1 + 4.0 here.
ART_CLIP_DEFAULTS: dict[str, tuple[float, float | None]] = {"ppo": (0.2, None), "cispo": (1.0, 4.0)}


WIRE_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
WIRE_NAMES = {"beta": "dro_beta"}
EPSILONS = ("epsilon", "epsilon_high")
KLMode = Literal["loss", "advantage"]


@dataclass(frozen=True)
class LossConfig:
    """Options of the losses, each a `train()` option of the same name. `None` clip bounds take
    each loss's default."""

    epsilon: float | None = option(
        None,
        "clip range low side: ratio >= 1 - epsilon (None: the loss's default)",
        Check("in [0, 1] (the clip floor is 1 - epsilon)", lambda v: 0 <= v <= 1),
        applies_to=RATIO_LOSSES,
    )
    epsilon_high: float | None = option(
        None,
        "clip range high side: ratio <= 1 + epsilon_high (None: epsilon)",
        Check("a finite number >= 0 (the clip ceiling is 1 + epsilon_high)", NON_NEGATIVE.ok),
        applies_to=RATIO_LOSSES,
    )
    dro_beta: float = option(
        0.05, "quadratic penalty of the dro loss", NON_NEGATIVE, applies_to=("dro",)
    )
    importance_sampling_level: ImportanceSamplingLevel = option(
        "token",
        "token ratios, one ratio per sequence (GSPO), or a mix",
        applies_to=RATIO_LOSSES,
    )
    truncated_importance_sampling: float | None = option(
        None,
        "cap U on the trainer/sampler ratio (needs precalculate_logprobs)",
        Check("a finite cap > 0 (None: no cap)", lambda v: 0 < v < math.inf),
        applies_to=RATIO_LOSSES,
    )
    mask_prob_ratio: bool = option(
        False, "zero the loss of tokens whose ratio leaves the clip band", applies_to=RATIO_LOSSES
    )
    max_negative_advantage_importance_sampling_weight: float | None = option(
        None,
        "cap M on the ratio of tokens with a negative advantage, r <- min(r, M) where A < 0 "
        "(as named; ART caps every token's ratio)",
        Check("a finite cap > 0 (None: no cap)", POSITIVE.ok),
        applies_to=RATIO_LOSSES,
    )
    kimi_k2_tau: float | None = option(
        None,
        "Kimi K2's tau: advantages minus tau times the log-ratio",
        NON_NEGATIVE,
        applies_to=RATIO_LOSSES,
    )
    kl_penalty_coef: float = option(
        0.0,
        "KL penalty weight against the base model (LoRA disabled)",
        NON_NEGATIVE,
        applies_to=RATIO_LOSSES,
    )
    kl_estimator: KLEstimator = option(
        "k3", "k1 (log-ratio) or k3 (Schulman's unbiased, non-negative) estimator"
    )
    kl_mode: KLMode = option(
        "loss", "add the KL to the loss, or shape the advantages with it (ART)"
    )
    allow_training_without_logprobs: bool = option(
        False, "train trajectories without sampler logprobs (ratio 1)"
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, ConfigValue], loss_fn: str | None = None
    ) -> LossConfig:
        """Parse a `loss_fn_config`: Tinker's keys (clip_low_threshold, clip_high_threshold,
        dro's beta) or LossConfig's own; a None value means the default (`algo.loss_wire`)."""
        return from_loss_fn_config(cls, values, loss_fn)


@dataclass(frozen=True)
class LossBatch:
    """Padded per-token tensors of one micro-batch; padding has weights 0 and mask 0.

    `logp_BT` is the learner's log p(target) and carries the gradient. `inputs` holds the
    datums' `loss_fn_inputs` padded to [B, T]: `target_tokens`, and as the loss needs them
    `weights`, `advantages`, `logprobs` (behaviour policy), `mask`, `sampler_logprobs`,
    `ref_logprobs`, per-token `clip_low_threshold`/`clip_high_threshold`. `entropy_BT` (no
    gradient) is optional, for diagnostics only.

    Weights `w` default to 1 on real tokens. The mask `m` (inputs["mask"]; else weights ≠ 0 if
    weights are given; else the real tokens) marks the tokens that count: it gates the loss and
    picks the tokens of sequence means (gspo: inputs["sequence_ratio_mask"] if given), KL
    centring, missing-logprob checks and diagnostics. Sequence-level ratios and KL need a mask or
    weights that leave out prompt tokens, whose `logprobs` are placeholders.
    """

    logp_BT: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    pad_mask_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_shapes(self.logp_BT, self.inputs, self.pad_mask_BT, self.entropy_BT)


def check_shapes(
    logp_BT: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    pad_mask_BT: torch.Tensor,
    entropy_BT: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the first per-token tensor whose shape is not logp_BT's [B, T]."""
    shape = tuple(logp_BT.shape)
    if len(shape) != 2:
        raise ValueError(f"LossBatch.logp_BT must be 2-D [B, T], got shape {shape}")
    named = [("pad_mask_BT", pad_mask_BT), ("entropy_BT", entropy_BT)]
    named += [(f"inputs[{key!r}]", inputs[key]) for key in PER_TOKEN_INPUTS if key in inputs]
    for name, tensor in named:
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"LossBatch.{name} has shape {tuple(tensor.shape)} but logp_BT has shape {shape}: "
                f"give exactly one value per target token, logp_BT's [B, T] (no broadcasting: "
                f"repeat a per-sequence [B, 1] value over its row's tokens; an input one longer "
                f"than T is aligned with the whole sequence, not with target_tokens)"
            )


def from_loss_fn_config(
    cls: type[LossConfig], values: Mapping[str, ConfigValue], loss_fn: str | None
) -> LossConfig:
    """Parse a `loss_fn_config` (Tinker's keys or LossConfig's own; None means the default).

    Thresholds and epsilons are either form, not both. A bound left out is the loss's default,
    as in Tinker, so a lone clip_low_threshold needs `loss_fn` to know the high one.
    """
    given = {key: value for key, value in values.items() if value is not None}
    names = [f.name for f in fields(cls)]
    reject_unknown_keys(given, [*names, *WIRE_THRESHOLDS, *WIRE_NAMES], "loss config")
    kwargs: dict[str, Any] = {}
    for key, value in given.items():
        name = WIRE_NAMES.get(key, key)
        if name in kwargs:
            twice = [k for k in given if WIRE_NAMES.get(k, k) == name]
            raise ValueError(f"loss config gives {name} twice ({twice}): give one of them")
        if key not in WIRE_THRESHOLDS:
            kwargs[name] = value
    kwargs.update(_epsilons_of_thresholds(given, loss_fn))
    try:
        return cls(**kwargs)
    except ValueError as exc:  # name the key the caller sent, not only the field it became
        wire = {**dict(zip(WIRE_THRESHOLDS, EPSILONS, strict=True)), **WIRE_NAMES}
        used = [k for k, name in wire.items() if k in given and f"option {name}=" in str(exc)]
        if not used:
            raise
        raise ValueError(
            f"{exc} (from Tinker's {used[0]}: epsilon = 1 - clip_low_threshold, "
            f"epsilon_high = clip_high_threshold - 1, dro_beta = beta)"
        ) from None


def _epsilons_of_thresholds(
    values: Mapping[str, ConfigValue], loss_fn: str | None
) -> dict[str, float]:
    """epsilon / epsilon_high from Tinker's absolute clip thresholds in `values`, if given."""
    lo = read_optional_number(values, WIRE_THRESHOLDS[0])
    hi = read_optional_number(values, WIRE_THRESHOLDS[1])
    if lo is None and hi is None:
        return {}
    given = [key for key in (*EPSILONS, *WIRE_THRESHOLDS) if values.get(key) is not None]
    if any(key in EPSILONS for key in given):
        raise ValueError(
            f"give the clip range as clip_low_threshold/clip_high_threshold or as "
            f"epsilon/epsilon_high, not both (got {given})"
        )
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clip_low_threshold ({lo}) must be <= clip_high_threshold ({hi})")
    if lo is not None and hi is None:
        if loss_fn is None:
            raise ValueError(
                "clip_low_threshold without clip_high_threshold takes the loss's default "
                "high bound: give both, or parse with the loss's name"
            )
        if loss_fn in DEFAULT_THRESHOLDS:
            hi = DEFAULT_THRESHOLDS[loss_fn][1]
    out: dict[str, float] = {}
    if lo is not None:
        out["epsilon"] = 1 - lo
    if hi is not None:
        out["epsilon_high"] = hi - 1
    return out
