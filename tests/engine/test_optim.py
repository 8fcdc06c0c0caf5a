"""Tests for AdamW creation, per-call Adam settings and learning-rate schedules."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.engine.optim import (
    create_adamw_optimizer,
    create_lr_schedule,
    lr_multiplier,
    set_adam_params,
)


def _mult(step: int, decay: str = "cosine", min_lr_ratio: float = 0.1) -> float:
    return lr_multiplier(
        step,
        warmup_steps=4,
        total_steps=12,
        decay=decay,  # pyright: ignore[reportArgumentType]
        min_lr_ratio=min_lr_ratio,
    )


def test_lr_multiplier_hand_values() -> None:
    # Warm-up (step + 1) / 4: 0.25, 0.5, 0.75, 1.0 at steps 0..3.
    assert [_mult(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # Decay starts at step 4 (p = 0) and ends at step 12 (p = 1), span 8.
    assert _mult(4) == 1.0
    # Cosine halfway, step 8, p = 0.5: 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.1 + 0.45 = 0.55.
    assert _mult(8) == pytest.approx(0.55, rel=1e-15)
    # Cosine step 6, p = 0.25: 0.1 + 0.9 * (1 + 0.70710678) / 2 = 0.86819805.
    assert _mult(6) == pytest.approx(0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2, rel=1e-15)
    assert _mult(6) == pytest.approx(0.86819805, rel=1e-8)
    # Linear step 6, p = 0.25: 0.1 + 0.9 * 0.75 = 0.775.
    assert _mult(6, "linear") == pytest.approx(0.775, rel=1e-15)
    # End and beyond: the floor min_lr_ratio = 0.1.
    assert _mult(12) == pytest.approx(0.1, rel=1e-15)
    assert _mult(50) == pytest.approx(0.1, rel=1e-15)
    assert _mult(12, "linear") == pytest.approx(0.1, rel=1e-15)
    # Constant stays at the peak after warm-up and ignores the floor.
    assert [_mult(s, "constant") for s in (3, 4, 8, 12, 50)] == [1.0] * 5


def test_no_warmup_starts_at_peak() -> None:
    assert lr_multiplier(0, warmup_steps=0, total_steps=10) == 1.0
    # Warm-up over every step: never decays.
    assert lr_multiplier(9, warmup_steps=10, total_steps=10) == 1.0
    assert lr_multiplier(10, warmup_steps=10, total_steps=10) == 1.0


@settings(max_examples=50, deadline=None)
@given(
    warmup=st.integers(0, 20),
    extra=st.integers(1, 50),
    min_lr_ratio=st.floats(0.0, 1.0),
    decay=st.sampled_from(["cosine", "linear"]),
)
def test_decay_invariants(warmup: int, extra: int, min_lr_ratio: float, decay: str) -> None:
    total = warmup + extra

    def m(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=warmup,
            total_steps=total,
            decay=decay,  # pyright: ignore[reportArgumentType]
            min_lr_ratio=min_lr_ratio,
        )

    values = [m(s) for s in range(total + 3)]
    # Warm-up rises strictly within (0, 1]; after it the schedule never rises and stays in
    # [min, 1] (1e-15: one rounding of min + (1 - min) * shape).
    assert all(a < b for a, b in itertools.pairwise(values[:warmup]))
    decay_values = values[warmup:]
    assert all(b <= a + 1e-15 for a, b in itertools.pairwise(decay_values))
    assert all(0.0 < v <= 1.0 for v in values[:warmup])
    assert all(min_lr_ratio - 1e-15 <= v <= 1.0 for v in decay_values)
    # Both shapes are point-symmetric about the decay midpoint: s(p) + s(1 - p) = 1, so
    # m(warmup + k) + m(total - k) = 2 min + (1 - min) = 1 + min. Rounding of cos: 1e-12.
    for k in range(extra + 1):
        assert m(warmup + k) + m(total - k) == pytest.approx(1 + min_lr_ratio, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(warmup_steps=5, total_steps=4), "warmup_steps <= total_steps"),
        (dict(warmup_steps=-1, total_steps=4), "warmup_steps"),
        (dict(warmup_steps=0, total_steps=0), "total_steps >= 1"),
        (dict(warmup_steps=0, total_steps=4, decay="exp"), "decay must be one of"),
        (dict(warmup_steps=0, total_steps=4, min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(warmup_steps=0, total_steps=4, min_lr_ratio=float("nan")), "min_lr_ratio"),
    ],
)
def test_schedule_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lr_multiplier(0, **kwargs)
    optimizer = create_adamw_optimizer([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=match):
        create_lr_schedule(optimizer, **kwargs)


def test_negative_step_rejected() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_multiplier(-1, warmup_steps=0, total_steps=4)


def test_lr_schedule_drives_optimizer_lr() -> None:
    optimizer = create_adamw_optimizer([torch.nn.Parameter(torch.zeros(2))], lr=2e-3)
    schedule = create_lr_schedule(
        optimizer, warmup_steps=4, total_steps=12, decay="cosine", min_lr_ratio=0.1
    )
    seen = []
    for _ in range(14):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    # Exactly peak * multiplier: LambdaLR multiplies the initial lr by our function.
    assert seen == [2e-3 * _mult(s) for s in range(14)]


def _naive_adamw(p: list[float], grads: list[list[float]], lr, betas, eps, wd) -> list[float]:
    """Per-element AdamW (Loshchilov & Hutter 2019, Algorithm 2) as a plain python loop."""
    p = list(p)
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        for i in range(len(p)):
            p[i] -= lr * wd * p[i]
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g[i]
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g[i] ** 2
            m_hat = m[i] / (1 - betas[0] ** t)
            v_hat = v[i] / (1 - betas[1] ** t)
            p[i] -= lr * m_hat / (math.sqrt(v_hat) + eps)
    return p


@settings(max_examples=30, deadline=None)
@given(
    data=st.lists(st.floats(-3, 3), min_size=5, max_size=5),
    seed=st.integers(0, 2**16),
    lr=st.floats(1e-5, 1e-1),
    wd=st.sampled_from([0.0, 0.01, 0.1]),
)
def test_adamw_matches_naive_loop(data: list[float], seed: int, lr: float, wd: float) -> None:
    betas, eps = (0.9, 0.95), 1e-8
    grads_SN = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    param = torch.nn.Parameter(torch.tensor(data, dtype=torch.float64))
    optimizer = create_adamw_optimizer([param], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for grad_N in grads_SN:
        param.grad = grad_N.clone()
        optimizer.step()
    expected = _naive_adamw(data, grads_SN.tolist(), lr, betas, eps, wd)
    # float64, three steps of a handful of flops each, different operation order: ~1e-15
    # relative per step; 1e-12 absolute leaves room without hiding a wrong formula.
    torch.testing.assert_close(
        param.detach(), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )


def test_adamw_defaults_and_implementation() -> None:
    optimizer = create_adamw_optimizer([torch.nn.Parameter(torch.zeros(2))])
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        1e-4,
        (0.9, 0.95),
        1e-12,
        0.0,
    )
    assert group["foreach"] is True  # CPU parameters: the multi-tensor implementation
    assert not group["fused"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lr=-1.0), "lr must be >= 0"),
        (dict(lr=float("nan")), "lr must be >= 0"),
        (dict(betas=(1.0, 0.95)), r"betas\[0\]"),
        (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
        (dict(eps=0.0), "eps must be > 0"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
    ],
)
def test_adam_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_adamw_optimizer([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    optimizer = create_adamw_optimizer([torch.nn.Parameter(torch.zeros(2))])
    full: dict = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0) | kwargs
    with pytest.raises(ValueError, match=match):
        set_adam_params(optimizer, **full)


def test_no_parameters_rejected() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        create_adamw_optimizer([])


def test_set_adam_params_equals_fresh_optimizer() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    grads = [torch.randn_like(p) for p in a]
    optimizer = create_adamw_optimizer(a[:1])
    optimizer.add_param_group({"params": a[1:]})  # two groups: both must be updated
    set_adam_params(optimizer, lr=3e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
            3e-2,
            (0.8, 0.9),
            1e-6,
            0.05,
        )
    reference = create_adamw_optimizer(b, lr=3e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    for params, opt in ((a, optimizer), (b, reference)):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    # Same settings, same arithmetic: bit-identical.
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
