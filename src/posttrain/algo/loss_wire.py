"""LossConfig -> Tinker's `loss_fn_config`: what TinkerTrainingClient sends. The other way,
how `posttrain serve` reads it back, is `LossConfig.from_mapping` (`algo.loss_config`, which
says how the two vocabularies differ)."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from posttrain.algo.loss_config import EPSILONS

if TYPE_CHECKING:
    from posttrain.algo.loss_config import LossConfig

# Read only with kl_penalty_coef > 0 (itself refused where it cannot travel): free to be sent.
KL_SHAPE = ("kl_estimator", "kl_mode")


def to_loss_fn_config(loss_fn: str, config: LossConfig) -> dict[str, float]:
    """`config` for loss `loss_fn` as Tinker's `loss_fn_config`: the clip range as absolute
    thresholds (each only when set), and dro's beta for dro.

    Raises ValueError naming the first option set away from its default that Tinker's
    protocol does not carry.
    """
    carried = ("dro_beta", *EPSILONS) if loss_fn == "dro" else EPSILONS
    for config_field in fields(config):
        name, value = config_field.name, getattr(config, config_field.name)
        if name not in carried and name not in KL_SHAPE and value != config_field.default:
            raise ValueError(
                f"loss option {name}={value!r} is not carried by the Tinker protocol; "
                "train with LocalBackend or RayBackend to use it"
            )
    out: dict[str, float] = {}
    eps = config.epsilon
    eps_high = eps if config.epsilon_high is None else config.epsilon_high
    if eps is not None:
        out["clip_low_threshold"] = 1 - eps
    if eps_high is not None:
        out["clip_high_threshold"] = 1 + eps_high
    if loss_fn == "dro":
        out["beta"] = config.dro_beta
    return out
