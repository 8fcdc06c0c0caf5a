"""The SEPA controller (retrain's selective execution-token pooling): how strongly `gtpo_sepa`
pools the uncertainty of execution tokens, step by step.

lambda in [0, 1] is resolved once per RL step from the state the earlier steps left:
- linear: lambda_lin(k) = clamp((k - sepa_delay_steps) / sepa_steps, 0, 1), k = steps done;
- auto: max(lambda_auto, lambda_lin), lambda_auto = 1 - min((var_ema / var_0) / 0.2, 1), where
  var_ema is an EMA of the variance of the step's execution-token uncertainties and var_0 its
  value after `sepa_warmup_steps` steps (0 until then);
- a correctness gate keeps lambda at 0 until one step's fraction of correct completions
  reaches `sepa_correct_rate_gate`; it then stays open.
After the step, `sepa_observe` folds in what the step saw. The state is plain JSON
(`SEPAState.state_dict`), saved with each checkpoint so that a resumed run continues exactly.

Unlike retrain, which updates the EMA and counts its warm-up once per completion (its docs say
per step), both count RL steps here: one EMA update per step, of the variance pooled over all
the step's execution tokens, so the schedule does not change with the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

import torch

from posttrain.algo.config_fields import AT_LEAST_ONE, Check, check_fields, option

SEPASchedule = Literal["linear", "auto"]
# retrain's constants: lambda_auto reaches 1 as var_ema falls to 0 and is 0 while var_ema is
# at least 20% of var_0; eps keeps the ratio finite.
SEPA_VAR_THRESHOLD = 0.2
SEPA_EPS = 1e-8
# A completion counts as correct for the gate when its reward is above this (retrain's rule,
# for rewards in [0, 1]).
CORRECT_REWARD = 0.5

_STEPS = Check("an integer >= 0", lambda v: v >= 0)
_FRACTION = Check("in [0, 1]", lambda v: 0 <= v <= 1)


@dataclass(frozen=True)
class SEPAConfig:
    """Options of the SEPA controller (read by token_transform='gtpo_sepa' only)."""

    sepa_schedule: SEPASchedule = option(
        "linear",
        "gtpo_sepa's pooling schedule: linear ramp, or auto (also rises as the execution "
        "tokens' uncertainty variance decays)",
    )
    sepa_steps: int = option(500, "RL steps over which the linear ramp goes from 0 to 1", _STEPS)
    sepa_delay_steps: int = option(50, "RL steps before the linear ramp starts", _STEPS)
    sepa_correct_rate_gate: float = option(
        0.1,
        "pooling stays off until a step's fraction of completions with reward > 0.5 reaches "
        "this (0: on from the start)",
        _FRACTION,
    )
    sepa_warmup_steps: int = option(
        50, "auto schedule: RL steps whose variance EMA becomes the baseline", AT_LEAST_ONE
    )
    sepa_ema_decay: float = option(
        0.99,
        "auto schedule: per-step decay of the execution-uncertainty variance EMA",
        Check("in [0, 1)", lambda v: 0 <= v < 1),
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SEPAState:
    """What the controller carries from step to step (JSON: saved with each checkpoint)."""

    steps: int = 0  # RL steps observed so far: the k of lambda_lin(k)
    var_ema: float | None = None
    var_0: float | None = None  # set once `sepa_warmup_steps` variances were seen
    warmup_seen: int = 0
    gate_open: bool = False

    @classmethod
    def initial(cls, config: SEPAConfig) -> SEPAState:
        return cls(gate_open=config.sepa_correct_rate_gate <= 0)

    def state_dict(self) -> dict[str, str | int | float | bool | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, data: Mapping[str, object]) -> SEPAState:
        """The state a checkpoint saved; a malformed one is an error naming the key."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        missing = [k for k in known if k not in data]
        if unknown or missing:
            raise ValueError(
                f"the saved SEPA state has unknown keys {unknown} / lacks {missing}; expected "
                f"exactly {known} (was it written by another posttrain version?)"
            )
        gate_open = data["gate_open"]
        if not isinstance(gate_open, bool):
            raise ValueError(f"the saved SEPA state's gate_open must be a bool, got {gate_open!r}")
        return cls(
            steps=_count(data, "steps"),
            var_ema=_optional_number(data, "var_ema"),
            var_0=_optional_number(data, "var_0"),
            warmup_seen=_count(data, "warmup_seen"),
            gate_open=gate_open,
        )


def _count(data: Mapping[str, object], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the saved SEPA state's {key} must be an int >= 0, got {value!r}")
    return value


def _optional_number(data: Mapping[str, object], key: str) -> float | None:
    value = data[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the saved SEPA state's {key} must be a finite number or null")
    return float(value)


def linear_lambda(config: SEPAConfig, step: int) -> float:
    """lambda_lin(k) = clamp((k - delay) / steps, 0, 1); 0 when sepa_steps = 0."""
    if config.sepa_steps <= 0:
        return 0.0
    return min(max((step - config.sepa_delay_steps) / config.sepa_steps, 0.0), 1.0)


def auto_lambda(state: SEPAState) -> float:
    """lambda_auto = 1 - min((var_ema / var_0) / 0.2, 1); 0 before the baseline exists."""
    if state.var_ema is None or state.var_0 is None:
        return 0.0
    ratio = max(state.var_ema / max(state.var_0, SEPA_EPS), 0.0)
    return 1.0 - min(ratio / SEPA_VAR_THRESHOLD, 1.0)


def sepa_lambda(config: SEPAConfig, state: SEPAState) -> float:
    """The pooling strength of the step after `state.steps` steps."""
    if not state.gate_open:
        return 0.0
    linear = linear_lambda(config, state.steps)
    return max(auto_lambda(state), linear) if config.sepa_schedule == "auto" else linear


def sepa_observe(
    config: SEPAConfig, state: SEPAState, correct_rate: float, exec_u: torch.Tensor
) -> SEPAState:
    """The state after one step whose completions were `correct_rate` correct and whose
    execution tokens had uncertainties `exec_u` (all completions pooled)."""
    gate = config.sepa_correct_rate_gate
    gate_open = state.gate_open or gate <= 0 or correct_rate >= gate
    var_ema, var_0, seen = state.var_ema, state.var_0, state.warmup_seen
    if config.sepa_schedule == "auto" and exec_u.numel() > 0:
        var_b = float(exec_u.to(torch.float64).var(correction=0))
        d = config.sepa_ema_decay
        var_ema = var_b if var_ema is None else d * var_ema + (1.0 - d) * var_b
        if var_0 is None:
            seen += 1
            if seen >= config.sepa_warmup_steps:
                var_0 = max(var_ema, SEPA_EPS)
    return SEPAState(state.steps + 1, var_ema, var_0, seen, gate_open)
