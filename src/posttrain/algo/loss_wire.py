"""LossConfig <-> Tinker's `loss_fn_config`: the one translation each way.

Tinker names two things differently from posttrain's options: the clip range travels as
absolute ratio bounds (clip_low_threshold = 1 − epsilon, clip_high_threshold = 1 + epsilon_high)
and dro's penalty as `beta` (dro_beta). `to_loss_fn_config` is what TinkerTrainingClient sends;
`from_loss_fn_config` (LossConfig.from_mapping) is how `posttrain serve` reads it back. Every
other key is LossConfig's own field name. Both directions are exact for the thresholds that
matter: 1 − x is exact for a bound x in [0.5, 2] (Sterbenz), and x − 1 for any x >= 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from posttrain.algo.config_fields import ConfigValue, read_optional_number, reject_unknown_keys
from posttrain.algo.loss_checks import DEFAULT_THRESHOLDS

if TYPE_CHECKING:
    from posttrain.algo.losses import LossConfig

WIRE_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
WIRE_NAMES = {"beta": "dro_beta"}
EPSILONS = ("epsilon", "epsilon_high")
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
