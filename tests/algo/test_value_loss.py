import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from posttrain.algo.loss_metrics import summarize
from posttrain.algo.value_loss import explained_variance, value_loss

F64 = torch.float64
nan = math.nan


def naive_value_loss(
    v: list[float], old: list[float], ret: list[float], w: list[float], eps: float | None
) -> tuple[float, list[bool], list[float]]:
    """(Σ w·ℓ, clipped flags, dΣ/dv) token by token in Python floats, from the formula."""
    total, clipped, grad = [], [], []
    for vt, ot, rt, wt in zip(v, old, ret, w, strict=True):
        unclipped = 0.5 * (vt - rt) ** 2
        # v_clip = clamp(v, v_old − ε, v_old + ε), written as "v unless outside the range".
        # The range's ends are the rounded v_old ± ε, as the clamp sees them: testing
        # |v − v_old| <= ε instead rounds v − v_old, and a v one ulp past v_old + ε then counts
        # as inside (a flaky case hypothesis found: see the @example below).
        low, high = (vt, vt) if eps is None else (ot - eps, ot + eps)
        vc = low if vt < low else high if vt > high else vt
        clipped_loss = 0.5 * (vc - rt) ** 2
        is_clipped = clipped_loss > unclipped
        total.append(wt * max(unclipped, clipped_loss))
        clipped.append(is_clipped and wt != 0)
        # The clipped term is strictly larger only when v_clip ≠ v, i.e. v_clip is at a bound
        # of the clamp, where it does not depend on v.
        grad.append(0.0 if is_clipped else wt * (vt - rt))
    return math.fsum(total), clipped, grad


# ---------------------------------------------------------------- hand-derived values

# ε_v = 0.2, one row of 5 tokens, weights w = [1, 0.5, 2, 0.25, 0] (the last is padding).
# t0: v_old 1, v 1.5, R 2: v − v_old = 0.5 → clamp 0.2 → v_clip 1.2;
#     (1.5−2)² = 0.25 < (1.2−2)² = 0.64 → clip binds, ℓ = 0.32, ∂ℓ/∂v = 0
# t1: v_old 1, v 1.1, R 2: v − v_old = 0.1 inside the clip → v_clip = v;
#     both 0.81, ℓ = 0.405, ∂ℓ/∂v = v − R = −0.9
# t2: v_old 1, v 0.5, R 0: v − v_old = −0.5 → clamp −0.2 → v_clip 0.8;
#     0.25 < 0.64 → clip binds, ℓ = 0.32, ∂ℓ/∂v = 0
# t3: v_old 1, v 2, R 0: v − v_old = 1 → v_clip 1.2; 4 > 1.44: the unclipped term wins
#     (moving away from R is never clipped), ℓ = 2, ∂ℓ/∂v = v − R = 2
# Σ w·ℓ = 0.32 + 0.5·0.405 + 2·0.32 + 0.25·2 = 0.32 + 0.2025 + 0.64 + 0.5 = 1.6625
# ∂/∂v = [0, 0.5·(−0.9), 0, 0.25·2, 0] = [0, −0.45, 0, 0.5, 0]
# clipped = [1, 0, 1, 0, ·] → clip fraction over the 4 counted tokens = 2/4 = 0.5
HAND_V = [1.5, 1.1, 0.5, 2.0, nan]
HAND_OLD = [1.0, 1.0, 1.0, 1.0, nan]
HAND_RET = [2.0, 2.0, 0.0, 0.0, nan]
HAND_W = [1.0, 0.5, 2.0, 0.25, 0.0]


def hand_inputs():
    v = torch.tensor([HAND_V], dtype=F64, requires_grad=True)
    return v, torch.tensor([HAND_OLD], dtype=F64), torch.tensor([HAND_RET], dtype=F64)


def test_value_loss_hand_values_and_gradient():
    v, old, ret = hand_inputs()
    out = value_loss(v, old, ret, torch.tensor([HAND_W], dtype=F64), clip_eps=0.2)
    assert out.loss.item() == pytest.approx(1.6625, rel=1e-12)
    out.loss.backward()
    assert v.grad is not None
    assert v.grad[0].tolist() == pytest.approx([0.0, -0.45, 0.0, 0.5, 0.0], rel=1e-12, abs=0)
    assert out.per_token["value_clipped"].tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]
    assert out.mask_BT is not None
    assert out.mask_BT.tolist() == [[True, True, True, True, False]]
    # The project's metrics: the mean of the 0/1 diagnostic over counted tokens.
    assert summarize([out])["value_clipped:mean"] == 0.5
    assert summarize([out])["loss:sum"] == pytest.approx(1.6625, rel=1e-12)


def test_value_loss_without_clipping():
    # clip_eps None: ℓ = ½(v − R)² everywhere: t0 0.125, t1 0.405, t2 0.125, t3 2;
    # Σ w·ℓ = 0.125 + 0.2025 + 0.25 + 0.5 = 1.0775, ∂/∂v = w·(v − R) = [−0.5, −0.45, 1, 0.5, 0].
    v, old, ret = hand_inputs()
    out = value_loss(v, old, ret, torch.tensor([HAND_W], dtype=F64), clip_eps=None)
    assert out.loss.item() == pytest.approx(1.0775, rel=1e-12)
    out.loss.backward()
    assert v.grad is not None
    assert v.grad[0].tolist() == pytest.approx([-0.5, -0.45, 1.0, 0.5, 0.0], rel=1e-12, abs=0)
    assert not out.per_token["value_clipped"].any()


def test_value_loss_mask_overrides_weights_zero_rule():
    # An explicit mask counts t0, t1 only: Σ w·ℓ = 0.32 + 0.5·0.405 = 0.5225; clip fraction 1/2.
    v, old, ret = hand_inputs()
    mask = torch.tensor([[1, 1, 0, 0, 0]])
    out = value_loss(v, old, ret, torch.tensor([HAND_W], dtype=F64), clip_eps=0.2, mask_BT=mask)
    assert out.loss.item() == pytest.approx(0.5225, rel=1e-12)
    assert summarize([out])["value_clipped:mean"] == 0.5


def test_value_loss_rejects_bad_inputs():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        value_loss(z, z, torch.zeros(2, 4), z, clip_eps=0.2)
    with pytest.raises(ValueError, match="shape"):
        value_loss(z, z, z, z, clip_eps=0.2, mask_BT=torch.ones(3, 2))
    for eps in (0.0, -0.1, math.inf):
        with pytest.raises(ValueError, match="clip_eps"):
            value_loss(z, z, z, z, clip_eps=eps)


def test_explained_variance_hand_values():
    # R = [1, 2, 3, 4], V = [1, 2, 3, 3]: R − V = [0, 0, 0, 1], mean 1/4,
    # Var[R − V] = (3·(1/4)² + (3/4)²)/4 = (3/16 + 9/16)/4 = 3/16 = 0.1875,
    # Var[R] = (2.25 + 0.25 + 0.25 + 2.25)/4 = 1.25 → EV = 1 − 0.1875/1.25 = 0.85.
    # The padding token (R = 100, V = nan) does not count.
    ret = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 0.0]])
    v = torch.tensor([[1.0, 2.0, nan], [3.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert explained_variance(v, ret, mask) == pytest.approx(0.85, rel=1e-12)
    assert explained_variance(ret, ret, mask) == 1.0  # perfect critic
    assert explained_variance(torch.full_like(ret, 7.0), ret, mask) == 0.0  # constant critic
    assert math.isnan(explained_variance(v, torch.ones_like(ret), mask))  # Var[R] = 0
    assert math.isnan(explained_variance(v, ret, torch.zeros_like(mask)))  # no tokens


# ---------------------------------------------------------------- reference and properties

finite = st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False)


@st.composite
def rows(draw: st.DrawFn):
    """(v, v_old, R, w) lists of equal length; weights include 0 (uncounted) tokens."""
    T = draw(st.integers(1, 12))
    v, old, ret = (draw(st.lists(finite, min_size=T, max_size=T)) for _ in range(3))
    w = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 1 / 3, -1.0]), min_size=T, max_size=T))
    return v, old, ret, w


@settings(max_examples=200, deadline=None)
@given(rows(), st.one_of(st.none(), st.floats(0.01, 5.0)))
# v is one ulp above the rounded v_old + ε, while the rounded v − v_old is not above ε.
@example(
    ([0.8577387031699885], [-3.4959127450521983], [1.3502148124134372], [1.0]),
    4.353651448222187,
)
def test_value_loss_matches_naive_reference(row, eps):
    v, old, ret, w = row
    want_loss, want_clipped, want_grad = naive_value_loss(v, old, ret, w, eps)
    v_BT = torch.tensor([v], dtype=F64, requires_grad=True)
    out = value_loss(
        v_BT,
        torch.tensor([old], dtype=F64),
        torch.tensor([ret], dtype=F64),
        torch.tensor([w], dtype=F64),
        clip_eps=eps,
    )
    # float64 sums of <= 12 terms of size <= 200: 1e-12 relative to Σ|w·ℓ| is ample.
    scale = 1.0 + sum(abs(x) for x in w) * 200.0
    assert out.loss.item() == pytest.approx(want_loss, abs=1e-13 * scale)
    assert out.per_token["value_clipped"][0].tolist() == [float(c) for c in want_clipped]
    out.loss.backward()
    assert v_BT.grad is not None
    assert v_BT.grad[0].tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(rows(), st.floats(0.01, 5.0), st.integers(0, 12))
def test_value_loss_is_a_sum_over_any_split_of_tokens(row, eps, cut):
    # The contract of every loss: splitting a batch into micro-batches adds up to the same loss.
    v_BT, old_BT, ret_BT, w_BT = (torch.tensor([x], dtype=F64) for x in row)
    cut = min(cut, v_BT.shape[1])
    whole = value_loss(v_BT, old_BT, ret_BT, w_BT, clip_eps=eps).loss
    parts = [
        value_loss(v_BT[:, s], old_BT[:, s], ret_BT[:, s], w_BT[:, s], clip_eps=eps).loss
        for s in (slice(0, cut), slice(cut, None))
    ]
    assert float(whole) == pytest.approx(float(parts[0] + parts[1]), rel=1e-12, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(rows(), st.floats(0.01, 5.0))
def test_clipped_loss_bounds(row, eps):
    # ℓ_clip ≥ ½(v − R)² token by token, and a clip wider than every |v − v_old| changes nothing.
    v_BT, old_BT, ret_BT, _ = (torch.tensor([x], dtype=F64) for x in row)
    ones_BT = torch.ones_like(v_BT)
    unclipped = value_loss(v_BT, old_BT, ret_BT, ones_BT, clip_eps=None).loss
    clipped = value_loss(v_BT, old_BT, ret_BT, ones_BT, clip_eps=eps).loss
    wide = value_loss(v_BT, old_BT, ret_BT, ones_BT, clip_eps=21.0).loss  # |v − v_old| ≤ 20
    assert float(clipped) >= float(unclipped)
    assert float(wide) == float(unclipped)  # bit-identical: v_clip is exactly v


@settings(max_examples=100, deadline=None)
@given(rows())
def test_explained_variance_at_most_one_and_shift_invariant(row):
    v, _, ret, _ = row
    v_BT, ret_BT = torch.tensor([v], dtype=F64), torch.tensor([ret], dtype=F64)
    mask = torch.ones_like(v_BT)
    ev = explained_variance(v_BT, ret_BT, mask)
    if math.isnan(ev):
        assert float(ret_BT.var(correction=0)) == 0.0
        return
    assert ev <= 1.0
    # A constant offset of the critic leaves Var[R − V] unchanged (checked where Var[R] is not so
    # small that adding 3 to V rounds away R's spread).
    if float(ret_BT.var(correction=0)) < 1e-6:
        return
    shifted = explained_variance(v_BT + 3.0, ret_BT, mask)
    assert shifted == pytest.approx(ev, rel=1e-9, abs=1e-9)
