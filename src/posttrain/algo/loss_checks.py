"""Which inputs and options each loss of `algo.losses` takes, checked before any compute.

A loss given an option it would ignore raises instead of silently degrading, in the spirit of
SkyRL's per-loss whitelist of Tinker `loss_fn_config` keys: each LossConfig field names the
losses it applies to.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING

from posttrain.algo.config_fields import APPLIES_TO

if TYPE_CHECKING:
    import torch

    from posttrain.algo.losses import LossConfig

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


def resolved_thresholds(name: str, config: LossConfig) -> tuple[float, float]:
    """The (lo, hi) ratio bounds loss `name` uses: lo = 1 − epsilon, hi = 1 + epsilon_high
    (epsilon_high defaulting to epsilon), each the loss's default when not set."""
    if name not in DEFAULT_THRESHOLDS:
        raise ValueError(
            f"loss {name!r} has no clip thresholds; losses that do: {list(RATIO_LOSSES)}"
        )
    default_lo, default_hi = DEFAULT_THRESHOLDS[name]
    eps = config.epsilon
    eps_high = eps if config.epsilon_high is None else config.epsilon_high
    # The ranges of epsilon (in [0, 1]) and epsilon_high (>= 0) keep lo <= 1 <= hi.
    lo = default_lo if eps is None else 1 - eps
    hi = default_hi if eps_high is None else 1 + eps_high
    return lo, hi


def unused_options(name: str, config: LossConfig) -> list[tuple[str, tuple[str, ...]]]:
    """The options `config` sets away from their default that loss `name` would silently
    ignore (its field's `applies_to` leaves `name` out), each with the losses that read it."""
    _check_name(name)
    return [
        (f.name, applies)
        for f in fields(config)
        if (applies := f.metadata.get(APPLIES_TO)) is not None
        and name not in applies
        and getattr(config, f.name) != f.default
    ]


def check_config(name: str, config: LossConfig) -> None:
    """Raise ValueError if `config` sets an option that loss `name` would silently ignore
    (`unused_options`), or a combination the loss cannot honour."""
    unused = unused_options(name, config)
    if unused:
        raise ValueError(
            f"loss {name!r} does not use {[key for key, _ in unused]}; they apply to "
            f"{list(unused[0][1])}"
        )
    thresholds_set = [key for key in CLIP_KEYS if getattr(config, key) is not None]
    if name == "importance_sampling" and thresholds_set and not config.mask_prob_ratio:
        raise ValueError(
            f"importance_sampling does not clip: {thresholds_set} only set its mask_prob_ratio "
            f"band, so they need mask_prob_ratio=True"
        )
    if name == "gspo" and config.importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"gspo is sequence-level by definition: importance_sampling_level must be 'token' "
            f"(the default) or 'sequence', got {config.importance_sampling_level!r}"
        )


def check_inputs(name: str, keys: Collection[str], config: LossConfig | None = None) -> None:
    """Raise ValueError naming the loss_fn_input that loss `name` (with `config`) needs and
    `keys` lacks.
    """
    _check_name(name)
    for key in REQUIRED_INPUTS[name]:
        if key not in keys:
            raise ValueError(f"loss {name!r} needs loss_fn_inputs[{key!r}]; got {sorted(keys)}")
    if config is None:
        return
    if config.truncated_importance_sampling is not None and "sampler_logprobs" not in keys:
        raise ValueError(
            "truncated_importance_sampling needs loss_fn_inputs['sampler_logprobs'] (the rollout "
            "engine's logprobs; 'logprobs' then holds the trainer's recomputed old-policy ones)"
        )
    if config.kl_penalty_coef > 0 and "ref_logprobs" not in keys:
        raise ValueError("kl_penalty_coef > 0 needs loss_fn_inputs['ref_logprobs']")


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


def _check_name(name: str) -> None:
    if name not in REQUIRED_INPUTS:
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(REQUIRED_INPUTS)}")
