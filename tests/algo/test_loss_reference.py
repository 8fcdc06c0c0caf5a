"""(b) The losses of `algo.losses` against a naive per-token loop (tests/algo/naive_losses.py):
loss values and gradients wrt the learner's logprobs, for every loss and option, on random
rows drawn by hypothesis, in float64 and float32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from loss_helpers import POLICY, Row, W, column, make_batch, row_lists
from naive_losses import naive_loss_and_grad

from posttrain.algo.losses import LOSSES, LossConfig, get_loss

# (loss, config, loss_fn_inputs passed, logprobs with NaN holes): every loss and every option.
# (loss, config, loss_fn_inputs passed, logprobs with NaN holes): every loss and every option.
CASES: list[tuple[str, LossConfig, list[str], bool]] = [
    ("cross_entropy", LossConfig(), ["weights"], False),
    ("cross_entropy", LossConfig(), ["weights", "mask"], False),
    ("importance_sampling", LossConfig(), POLICY, False),
    ("ppo", LossConfig(), W, False),
    ("ppo", LossConfig(), [*W, "mask"], False),
    ("ppo", LossConfig(epsilon=0.1, epsilon_high=0.1), W, False),
    ("ppo", LossConfig(), [*W, "clip_low_threshold", "clip_high_threshold"], False),
    ("cispo", LossConfig(), W, False),
    ("cispo", LossConfig(epsilon=0.1, epsilon_high=0.1), W, False),
    ("dro", LossConfig(dro_beta=0.3), W, False),
    ("dro", LossConfig(allow_training_without_logprobs=True), W, True),
    ("gspo", LossConfig(), W, False),
    ("gspo", LossConfig(epsilon=0.2, epsilon_high=0.2), W, False),
    ("gspo", LossConfig(), [*W, "sequence_ratio_mask"], False),
    ("ppo", LossConfig(mask_prob_ratio=True), W, False),
    (
        "cispo",
        LossConfig(mask_prob_ratio=True, epsilon=0.1, epsilon_high=0.1),
        W,
        False,
    ),
    ("importance_sampling", LossConfig(mask_prob_ratio=True), W, False),
    ("ppo", LossConfig(kimi_k2_tau=0.3), W, False),
    ("cispo", LossConfig(kimi_k2_tau=0.3), W, False),
    ("ppo", LossConfig(truncated_importance_sampling=1.2), [*W, "sampler_logprobs"], False),
    ("cispo", LossConfig(truncated_importance_sampling=1.2), [*W, "sampler_logprobs"], False),
    ("gspo", LossConfig(truncated_importance_sampling=1.2), [*W, "sampler_logprobs"], False),
    ("ppo", LossConfig(allow_training_without_logprobs=True), W, True),
    ("gspo", LossConfig(allow_training_without_logprobs=True), W, True),
    *[
        (name, LossConfig(importance_sampling_level=level), W, False)
        for name in ("importance_sampling", "ppo", "cispo")
        for level in ("sequence", "average", "geometric_average")
    ],
    *[
        (
            name,
            LossConfig(kl_penalty_coef=0.2, kl_estimator=est, kl_mode=mode),
            [*W, "ref_logprobs"],
            False,
        )
        for name in ("ppo", "gspo")
        for est in ("k1", "k3")
        for mode in ("loss", "advantage")
    ],
]
CASE_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def _with_nan_logprobs(rows: list[Row], nan_holes: bool) -> list[Row]:
    return [{**row, "logprobs": row["q_with_nan"]} for row in rows] if nan_holes else rows


def test_cases_cover_every_loss():
    # The critic's "value" loss reads values, not logprobs: its naive reference is in
    # test_value_loss.py, and its registered form is checked against it in
    # tests/trainer/test_critic.py.
    assert {name for name, *_ in CASES} == set(LOSSES) - {"value"}


def _abs_weights(rows: list[Row], keys: list[str], width: int) -> torch.Tensor:
    """|w_t| per token ([B, width], 0 on padding): w = 1 on real tokens when no weights given."""
    if "weights" in keys:
        return column(rows, "weights", width).abs()
    return column([{"ones": [1.0] * len(row["lp"])} for row in rows], "ones", width)


@pytest.mark.parametrize(("name", "config", "keys", "nan_holes"), CASES, ids=CASE_IDS)
@settings(max_examples=20, deadline=None)
@given(rows=row_lists())
def test_matches_naive_loop(
    name: str, config: LossConfig, keys: list[str], nan_holes: bool, rows: list[Row]
):
    rows = _with_nan_logprobs(rows, nan_holes)
    width = max(len(row["lp"]) for row in rows) + 1  # one padded column, which must get grad 0
    want, scale, want_grad = naive_loss_and_grad(name, rows, keys, config, width)
    grad_scale = want_grad.abs() + _abs_weights(rows, keys, width)
    # Loss: relative to Σ|w·ℓ|, since the loss itself may cancel to ~0. Gradient: relative to
    # |g_t| + |w_t|, since g_t may cancel to ~0 too (dro's A − β(lp − q), Kimi's A − τΔ, k3's
    # β(1 − e^{ref−lp}), KL shaping) while every factor of it is O(1) in the drawn ranges
    # (|A| <= 2, r in e^±0.6, coefficients <= 0.7), so rounding is bounded by ulps of |w_t|.
    # fp64 differs from the reference only in rounding order (~1e-16 per op). In fp32 the inputs
    # are exact, so only the arithmetic rounds: a few ulps (~6e-8 each); measured over 150
    # draws per case, the worst was 1.9e-7 relative on loss values, 1.2e-7 on gradients.
    # The loss bound adds Σ|w_t| to Σ|w·ℓ| for the same reason: a token's ℓ may itself cancel
    # to ~0 from O(1) factors (gspo's sequence ratio times A, plus a KL term), and its rounding
    # is ulps of those factors, not of ℓ (one draw: 1.7e-8 error on Σ|w·ℓ| = 0.016).
    loss_scale = scale + float(_abs_weights(rows, keys, width).sum())
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        batch, logp = make_batch(rows, keys, dtype, extra_pad=1)
        loss = get_loss(name)(batch, config).loss
        assert abs(loss.item() - want) <= rtol * loss_scale, dtype
        if loss.requires_grad:
            loss.backward()
        grad = torch.zeros_like(want_grad) if logp.grad is None else logp.grad.double()
        error = (grad - want_grad).abs()
        assert bool((error <= rtol * grad_scale).all()), (dtype, error.max().item())
