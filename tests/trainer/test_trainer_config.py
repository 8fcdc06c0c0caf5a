"""Every float option of the trainer configs is range-checked, infinity included where it means
nothing, and the error names the option."""

from __future__ import annotations

import math
from typing import Any

import pytest

from posttrain.trainer.config import RLConfig, SFTConfig, from_options, option_fields

INF = math.inf


def float_options(config: type) -> list[str]:
    """Every float option of the config, through its nested groups (by flat key)."""
    return [key for key, f in option_fields(config).items() if "float" in str(f.annotation)]


@pytest.mark.parametrize(
    ("config", "name"),
    [(RLConfig, name) for name in float_options(RLConfig)]
    + [(SFTConfig, name) for name in float_options(SFTConfig)],
)
@pytest.mark.parametrize("value", [INF, -INF, math.nan])
def test_no_float_option_takes_infinity_or_nan(config: type, name: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"option {name}={value!r} is invalid"):
        from_options(config, {name: value})


def test_every_float_option_is_covered() -> None:
    # The parametrization above reads the fields: a new float option is tested without edits.
    assert {"learning_rate", "epsilon_high", "dro_beta", "truncated_importance_sampling"} <= set(
        float_options(RLConfig)
    )
    assert {"learning_rate", "min_lr_ratio", "grad_clip"} <= set(float_options(SFTConfig))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grad_clip": INF}, r"grad_clip=inf is invalid: expected a finite number >= 0 \(0 turns"),
        ({"truncated_importance_sampling": INF}, "a finite cap > 0 \\(None: no cap\\)"),
        ({"epsilon_high": INF}, "epsilon_high=inf is invalid: expected a finite number >= 0"),
    ],
)
def test_the_message_says_what_to_use_instead(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_options(RLConfig, options)
