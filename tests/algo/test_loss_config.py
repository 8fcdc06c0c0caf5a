"""LossConfig and Tinker's loss_fn_config: one translation each way (`to_loss_fn_config` out,
`from_mapping` in), exact where the floats allow, and the option fields' own checks."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.algo.config_fields import check_fields, option_defaults, option_fields
from posttrain.algo.loss_checks import DEFAULT_THRESHOLDS, check_config, resolved_thresholds
from posttrain.algo.loss_wire import to_loss_fn_config
from posttrain.algo.losses import LossConfig

RATIO_LOSSES = list(DEFAULT_THRESHOLDS)


@given(
    eps=st.none() | st.floats(0.0, 1.0),
    eps_high=st.none() | st.floats(0.0, 1e3),
    loss_fn=st.sampled_from(RATIO_LOSSES),
)
def test_a_config_survives_the_wire_bit_for_bit(eps, eps_high, loss_fn):
    # Out: lo = fl(1 − ε), hi = fl(1 + ε_high); in: ε' = 1 − lo, ε_high' = hi − 1. For lo in
    # [0.5, 1] the subtraction 1 − lo is exact (Sterbenz), and for ε in [0.5, 1] so is 1 − ε,
    # giving back ε itself; hi − 1 is exact for any hi >= 1. Either way fl(1 − ε') = lo and
    # fl(1 + ε_high') = hi: the server runs the very thresholds the client's loss would.
    config = LossConfig(epsilon=eps, epsilon_high=eps_high)
    back = LossConfig.from_mapping(to_loss_fn_config(loss_fn, config), loss_fn)
    assert resolved_thresholds(loss_fn, back) == resolved_thresholds(loss_fn, config)


@given(
    lo=st.floats(0.5, 1.0),
    hi=st.floats(1.0, 1e3),
    loss_fn=st.sampled_from(RATIO_LOSSES),
)
def test_thresholds_from_the_wire_are_the_thresholds_used(lo, hi, loss_fn):
    # Any bound in [0.5, 1] (low) or >= 1 (high) comes back exactly; a low bound under 0.5
    # may move by one ulp of its epsilon (1 − lo rounds there).
    config = LossConfig.from_mapping({"clip_low_threshold": lo, "clip_high_threshold": hi})
    assert resolved_thresholds(loss_fn, config) == (lo, hi)
    wire = to_loss_fn_config(loss_fn, config)
    assert wire == {"clip_low_threshold": lo, "clip_high_threshold": hi}


@pytest.mark.parametrize("loss_fn", RATIO_LOSSES)
def test_a_bound_left_out_on_the_wire_is_the_loss_default(loss_fn):
    default_lo, default_hi = DEFAULT_THRESHOLDS[loss_fn]
    low_only = LossConfig.from_mapping({"clip_low_threshold": 0.75}, loss_fn)
    assert resolved_thresholds(loss_fn, low_only) == (0.75, default_hi)
    high_only = LossConfig.from_mapping({"clip_high_threshold": 4.5}, loss_fn)
    assert resolved_thresholds(loss_fn, high_only) == (default_lo, 4.5)


def test_dro_beta_travels_as_tinker_beta_for_dro_only():
    assert to_loss_fn_config("dro", LossConfig(dro_beta=0.3)) == {"beta": 0.3}
    assert LossConfig.from_mapping({"beta": 0.3}) == LossConfig(dro_beta=0.3)
    assert to_loss_fn_config("ppo", LossConfig()) == {}
    with pytest.raises(ValueError, match=r"dro_beta=0\.3 is not carried"):
        to_loss_fn_config("ppo", LossConfig(dro_beta=0.3))


def set_value(name: str) -> Any:
    """A value of LossConfig's field `name` other than its default that the field accepts."""
    default = option_defaults(LossConfig)[name]
    candidates: tuple[Any, ...] = (True, "sequence", "k1", "advantage", 0.5, 2.0)
    for value in candidates:
        try:
            LossConfig(**{name: value})
        except ValueError:
            continue
        if value != default:
            return value
    raise AssertionError(f"no candidate value fits {name}")


def test_every_option_not_carried_is_refused_when_set():
    # A new LossConfig field is covered without edits: set it away from its default.
    carried = {"epsilon", "epsilon_high", "kl_estimator", "kl_mode"}
    for f in fields(LossConfig):
        if f.name in carried | {"dro_beta"}:
            continue
        value = set_value(f.name)
        with pytest.raises(ValueError, match=rf"{f.name}={value!r} is not carried"):
            to_loss_fn_config("ppo", LossConfig(**{f.name: value}))
    # Read only with kl_penalty_coef > 0, which is refused itself: sent as nothing.
    assert to_loss_fn_config("ppo", LossConfig(kl_estimator="k1", kl_mode="advantage")) == {}


def test_each_ratio_only_option_is_refused_by_the_losses_that_ignore_it():
    # `applies_to` on the field is the whole whitelist: no list of options elsewhere.
    for key, f in option_fields(LossConfig).items():
        applies = f.field.metadata.get("applies_to")
        if applies is None:
            continue
        value = set_value(key)
        for name in sorted((set(DEFAULT_THRESHOLDS) | {"cross_entropy", "dro"}) - set(applies)):
            with pytest.raises(ValueError, match=rf"loss '{name}' does not use \['{key}'\]"):
                check_config(name, LossConfig(**{key: value}))


def test_int_values_become_floats_as_the_old_reader_made_them():
    config = LossConfig.from_mapping({"beta": 1, "kl_penalty_coef": 0})
    assert isinstance(config.dro_beta, float) and isinstance(config.kl_penalty_coef, float)
    check_fields(config)  # idempotent on a checked config
    assert type(LossConfig(epsilon=1).epsilon) is float
