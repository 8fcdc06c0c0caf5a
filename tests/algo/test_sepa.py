"""The SEPA controller: its lambda over 100 synthetic steps against a hand-run of the
schedule, and its state through JSON (what a checkpoint keeps)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.algo.sepa import SEPAConfig, SEPAState, sepa_lambda, sepa_observe


def run(config: SEPAConfig, steps: int, correct, exec_u, state: SEPAState | None = None):
    """lambda of each step, resolved before it, then the step observed; and the last state."""
    state = state or SEPAState.initial(config)
    lambdas = []
    for k in range(state.steps, state.steps + steps):
        lambdas.append(sepa_lambda(config, state))
        state = sepa_observe(config, state, correct(k), exec_u(k))
    return lambdas, state


def test_linear_schedule_with_delay_and_gate_over_100_steps():
    config = SEPAConfig(sepa_steps=40, sepa_delay_steps=10, sepa_correct_rate_gate=0.5)
    # Steps 0-14 are 20% correct, step 15 is 60%: the gate opens after step 15, for good
    # (step 16 back to 20% does not close it).
    correct = lambda k: 0.6 if k == 15 else 0.2  # noqa: E731
    lambdas, state = run(config, 100, correct, lambda k: torch.zeros(0))
    # Hand-run: lambda_k = 0 while the gate is closed (k <= 15); then clamp((k - 10) / 40, 0, 1):
    # 0.15 at k = 16, 1 from k = 50 on.
    expected = [0.0] * 16 + [(k - 10) / 40 for k in range(16, 50)] + [1.0] * 50
    assert lambdas == pytest.approx(expected, abs=1e-15)
    assert lambdas[16] == pytest.approx(0.15) and lambdas[49] == pytest.approx(0.975)
    assert state.steps == 100 and state.gate_open and state.var_ema is None  # linear: no EMA


def test_gate_zero_is_open_from_the_start_and_no_ramp_keeps_lambda_at_zero():
    open_gate = SEPAConfig(sepa_steps=4, sepa_delay_steps=0, sepa_correct_rate_gate=0.0)
    lambdas, _ = run(open_gate, 6, lambda k: 0.0, lambda k: torch.zeros(0))
    assert lambdas == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    no_ramp = SEPAConfig(sepa_steps=0, sepa_correct_rate_gate=0.0)
    assert run(no_ramp, 5, lambda k: 1.0, lambda k: torch.zeros(0))[0] == [0.0] * 5


def two_values(variance: float) -> torch.Tensor:
    """Execution uncertainties with exactly this population variance: 1 -/+ sqrt(variance)."""
    s = math.sqrt(variance)
    return torch.tensor([1.0 - s, 1.0 + s], dtype=torch.float64)


def test_auto_schedule_with_warmup_over_100_steps():
    config = SEPAConfig(
        sepa_schedule="auto",
        sepa_steps=0,  # no linear floor: lambda is lambda_auto alone
        sepa_correct_rate_gate=0.0,
        sepa_warmup_steps=3,
        sepa_ema_decay=0.5,
    )
    # Steps 0-2 see variance 4, every later step 0.4. EMA (decay 0.5) after step j:
    # 4 for j <= 2, so var_0 = 4 after the 3rd warm-up step; then 0.4 + 3.6 * 0.5^(j - 2).
    exec_u = lambda k: two_values(4.0 if k <= 2 else 0.4)  # noqa: E731
    lambdas, state = run(config, 100, lambda k: 1.0, exec_u)

    def ema_after(j: int) -> float:
        return 4.0 if j <= 2 else 0.4 + 3.6 * 0.5 ** (j - 2)

    # lambda_k = 1 - min((ema_after(k-1) / 4) / 0.2, 1) once var_0 exists (k >= 3), else 0:
    # 0 while the EMA is >= 0.8; 1 - 0.625 / 0.8 = 0.21875 at k = 7; -> 1 - 0.4 / 0.8 = 0.5.
    expected = [0.0] * 3 + [1 - min(ema_after(k - 1) / 0.8, 1.0) for k in range(3, 100)]
    # Variances of 1 -/+ sqrt(v) are v within a few ulps; the EMA keeps that relative error.
    assert lambdas == pytest.approx(expected, abs=1e-12)
    assert lambdas[6] == 0.0 and lambdas[7] == pytest.approx(0.21875, abs=1e-12)
    assert lambdas[99] == pytest.approx(0.5, abs=1e-12)
    assert state.var_0 == pytest.approx(4.0) and state.warmup_seen == 3


def test_auto_takes_the_larger_of_auto_and_linear():
    config = SEPAConfig(
        sepa_schedule="auto",
        sepa_steps=120,
        sepa_delay_steps=0,
        sepa_correct_rate_gate=0.0,
        sepa_warmup_steps=1,
        sepa_ema_decay=0.0,  # the EMA is the last step's variance
    )
    exec_u = lambda k: two_values(1.0 if k == 0 else 0.1)  # noqa: E731
    lambdas, _ = run(config, 100, lambda k: 1.0, exec_u)
    # Step 0 sets var_ema = var_0 = 1: lambda_auto = 0 at step 1, which takes the linear 1/120.
    # From step 2, var_ema = 0.1: lambda_auto = 1 - (0.1 / 1) / 0.2 = 0.5, until the linear
    # k / 120 passes it after k = 60.
    assert lambdas[:2] == [0.0, 1 / 120]
    assert lambdas[2:] == pytest.approx([max(0.5, k / 120) for k in range(2, 100)], abs=1e-12)
    assert lambdas[60] == pytest.approx(0.5) and lambdas[99] == pytest.approx(99 / 120)


def test_state_through_json_resumes_bit_for_bit():
    config = SEPAConfig(
        sepa_schedule="auto", sepa_steps=30, sepa_delay_steps=5, sepa_correct_rate_gate=0.3,
        sepa_warmup_steps=4, sepa_ema_decay=0.9,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rates = torch.rand(100, generator=gen, dtype=torch.float64).mul(0.4).tolist()
    values = [torch.rand(7, generator=gen, dtype=torch.float64) * 5 for _ in range(100)]
    whole, end = run(config, 100, lambda k: rates[k], lambda k: values[k])
    first, middle = run(config, 37, lambda k: rates[k], lambda k: values[k])
    saved = json.loads(json.dumps(middle.state_dict()))  # what trainer_state.json keeps
    rest, end2 = run(
        config, 63, lambda k: rates[k], lambda k: values[k], SEPAState.from_state_dict(saved)
    )
    assert first + rest == whole  # exact: JSON round-trips floats
    assert end2 == end


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": -1}, "steps must be an int >= 0"),
        ({"warmup_seen": 1.5}, "warmup_seen must be an int"),
        ({"gate_open": 1}, "gate_open must be a bool"),
        ({"var_ema": "x"}, "var_ema must be a finite number or null"),
        ({"extra": 1}, "unknown keys \\['extra'\\]"),
    ],
)
def test_a_malformed_saved_state_is_refused_naming_the_key(change, message):
    data = {**SEPAState().state_dict(), **change}
    with pytest.raises(ValueError, match=message):
        SEPAState.from_state_dict(data)
