"""Which inputs and options each loss of `algo.losses` takes, checked before any compute.

A loss given an option it would ignore raises instead of silently degrading, in the spirit of
SkyRL's per-loss whitelist of Tinker `loss_fn_config` keys: each LossConfig field names the
losses it applies to.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from typing import TYPE_CHECKING

from posttrain.algo.config_fields import APPLIES_TO
from posttrain.algo.loss_config import (
    CLIP_KEYS,
    DEFAULT_THRESHOLDS,
    RATIO_LOSSES,
    REQUIRED_INPUTS,
)

if TYPE_CHECKING:
    from posttrain.algo.loss_config import LossConfig


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


def _check_name(name: str) -> None:
    if name not in REQUIRED_INPUTS:
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(REQUIRED_INPUTS)}")
