"""Token transforms: hand-derived values, a naive per-token reference, and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_token_transforms import naive_group, naive_threshold, naive_whiten

from posttrain.algo.advantages import AdvantageConfig
from posttrain.algo.token_transforms import (
    TOKEN_TRANSFORMS,
    GroupTokens,
    gtpo_weights,
    hicra,
    sepa_pool,
    top_rho_threshold,
    transform_group,
    whiten,
)
from posttrain.trainer.config import RLConfig, from_options


def t64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# The 1e-8 in GTPO's denominator moves w_t by beta (h_t / mean h) 1e-8 / mean h: at most 2e-8
# for the values below (beta 2, h_t 4, mean h 2); everything else is exact float64 arithmetic.
HAND = 5e-8


def test_gtpo_hand_values():
    # u = [1, 2, 3], beta 0.1: mean h = 2, h / 2 = [0.5, 1, 1.5],
    # w = 1 + 0.1 * ([0.5, 1, 1.5] - 1) = [0.95, 1.0, 1.05]; A = 2 -> [1.9, 2.0, 2.1].
    assert (2 * gtpo_weights(t64([1, 2, 3]), 0.1)).tolist() == pytest.approx(
        [1.9, 2.0, 2.1], abs=HAND
    )
    # beta 2, u = [0, 4]: mean 2, w = [1 + 2 (0 - 1), 1 + 2 (2 - 1)] = [-1 -> 0, 3].
    assert gtpo_weights(t64([0, 4]), 2.0).tolist() == pytest.approx([0.0, 3.0], abs=HAND)
    # u above 50 is capped: h = [50, 50], all weights 1.
    assert gtpo_weights(t64([100, 50]), 0.5).tolist() == pytest.approx([1.0, 1.0], abs=HAND)
    # mean h < 1e-7 (nothing to weigh by) and beta = 0 leave the weights at 1.
    assert gtpo_weights(t64([0, 0]), 0.5).tolist() == [1.0, 1.0]
    assert gtpo_weights(t64([1, 9]), 0.0).tolist() == [1.0, 1.0]


def test_hicra_hand_values():
    # A = -2 over u = [1, 2, 3] with gtpo beta 0.1: [-1.9, -2.0, -2.1]; planning [1, 0, 1],
    # alpha 0.2: a + 0.2 |a| -> [-1.9 + 0.38, -2.0, -2.1 + 0.42] = [-1.52, -2.0, -1.68].
    a = -2 * gtpo_weights(t64([1, 2, 3]), 0.1)
    assert hicra(a, t64([1, 0, 1]), 0.2).tolist() == pytest.approx([-1.52, -2.0, -1.68], abs=HAND)


def test_sepa_pool_and_gtpo_sepa_hand_values():
    # u = [1, 2, 3, 6], planning [0, 0, 1, 0], lambda 0.5: execution mean (1 + 2 + 6) / 3 = 3,
    # execution h -> 0.5 * 3 + 0.5 * h = [2, 2.5, 4.5]; the planning token keeps 3.
    pooled = sepa_pool(t64([1, 2, 3, 6]), t64([0, 0, 1, 0]), 0.5)
    assert pooled.tolist() == [2.0, 2.5, 3.0, 4.5]
    # Then gtpo, beta 0.1: mean 12 / 4 = 3, h / 3 = [2/3, 5/6, 1, 1.5],
    # w = [1 - 0.1/3, 1 - 0.1/6, 1, 1.05].
    group = GroupTokens([1.0], [t64([1, 2, 3, 6])], [t64([0, 0, 1, 0])])
    (a,), _ = transform_group(group, "gtpo_sepa", beta=0.1, lam=0.5)
    assert a.tolist() == pytest.approx([1 - 0.1 / 3, 1 - 0.1 / 6, 1.0, 1.05], abs=HAND)
    # lambda 0 is plain gtpo; lambda 1 gives every execution token the mean.
    assert sepa_pool(t64([1, 2, 3, 6]), t64([0, 0, 1, 0]), 0.0).tolist() == [1, 2, 3, 6]
    assert sepa_pool(t64([1, 2, 3, 6]), t64([0, 0, 1, 0]), 1.0).tolist() == [3, 3, 3, 3]


def test_entropy_mask_hand_values():
    # The group's u: [1, 5, 3] and [4, 2]; rho 0.4 of 5 tokens -> k = 2 -> threshold 4 (the
    # 2nd largest); only u >= 4 keeps its advantage. beta 0: each token carries its A.
    group = GroupTokens([1.0, -1.0], [t64([1, 5, 3]), t64([4, 2])], None)
    (a0, a1), zeroed = transform_group(group, "entropy_mask", beta=0.0, rho=0.4)
    assert a0.tolist() == [0.0, 1.0, 0.0] and a1.tolist() == [-1.0, 0.0]
    assert zeroed == 3
    # Ties at the threshold are kept: u = [2, 2, 2], rho 0.34 -> k = 1, threshold 2, all kept.
    assert top_rho_threshold(t64([2, 2, 2]), 0.34) == 2.0
    # rho * N that floats just under an integer still counts it: 0.3 * 10 = 2.9999999999999996.
    assert top_rho_threshold(t64(list(range(10))), 0.3) == 7.0


def test_whiten_counts_real_zero_advantages():
    # [2, 0, 0, 1]: mean 0.75, deviations [1.25, -0.75, -0.75, 0.25], population variance
    # (1.5625 + 0.5625 + 0.5625 + 0.0625) / 4 = 0.6875, sigma = 0.8291561975888.
    # The two real zeros are advantages like any other (retrain would skip them as padding and
    # whiten [2, 1] alone to [1, -1]).
    sigma = math.sqrt(0.6875)
    want = [d / (sigma + 1e-8) for d in (1.25, -0.75, -0.75, 0.25)]
    assert whiten(t64([2, 0, 0, 1])).tolist() == pytest.approx(want, rel=1e-12)
    assert want[1] == pytest.approx(-0.904534, abs=1e-6)
    # sigma < 1e-8: only centred.
    assert whiten(t64([3, 3, 3])).tolist() == [0.0, 0.0, 0.0]
    assert whiten(t64([])).tolist() == []


def random_group(gen: torch.Generator, sizes: list[int]) -> tuple[list[float], list, list]:
    adv = (torch.randn(len(sizes), generator=gen, dtype=torch.float64) * 2).tolist()
    # Uncertainties in [0, 60): some above the cap of 50, some exactly 0.
    u = [(torch.rand(n, generator=gen, dtype=torch.float64) * 60).tolist() for n in sizes]
    for u_i in u[:1]:
        u_i[0] = 0.0
    plan = [(torch.rand(n, generator=gen) < 0.3).int().tolist() for n in sizes]
    return adv, u, plan


@pytest.mark.parametrize("transform", TOKEN_TRANSFORMS)
@pytest.mark.parametrize("seed", range(5))
def test_every_transform_matches_the_naive_per_token_loop(transform, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(n) for n in torch.randint(1, 12, (4,), generator=gen)]
    adv, u, plan = random_group(gen, sizes)
    beta, alpha, lam, rho = (float(x) for x in torch.rand(4, generator=gen, dtype=torch.float64))
    beta *= 3  # some weights clip at 0
    group = GroupTokens(adv, [t64(x) for x in u], [t64(p) for p in plan])
    got, _ = transform_group(group, transform, beta=beta, alpha=alpha, lam=lam, rho=rho)
    want = naive_group(transform, adv, u, plan, beta=beta, alpha=alpha, lam=lam, rho=rho)
    # Same float64 formulas, summed in a different order: a few ulps of |a| <= ~10.
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == pytest.approx(w, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_threshold_and_whiten_match_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(37, generator=gen, dtype=torch.float64) * 3).tolist()
    for rho in (0.01, 0.2, 0.5, 1.0):
        assert top_rho_threshold(t64(values), rho) == naive_threshold(values, rho)
    assert whiten(t64(values)).tolist() == pytest.approx(naive_whiten(values), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    u=st.lists(st.floats(0.0, 49.0), min_size=1, max_size=20),
    beta=st.floats(0.0, 1.0),
)
def test_gtpo_keeps_each_completions_mean_advantage(u, beta):
    # beta <= 1 and h >= 0 give w >= 1 - beta >= 0: no weight clips, so mean_t w_t =
    # 1 + beta (mean h / (mean h + 1e-8) - 1), which is 1 within beta * 1e-8 / mean h.
    w = gtpo_weights(t64(u), beta)
    mean_h = sum(u) / len(u)
    slack = 1e-8 / mean_h if mean_h >= 1e-7 else 0.0
    assert float(w.mean()) == pytest.approx(1.0, abs=beta * slack + 1e-12)


def test_algorithm_modes_set_estimator_and_transform():
    config = from_options(RLConfig, {"algorithm_mode": "maxrl_gtpo_sepa"}).advantages
    assert (config.advantage_estimator, config.tokens.token_transform) == ("maxrl", "gtpo_sepa")
    # retrain's grpo centres without the std: posttrain's dr_grpo.
    grpo = AdvantageConfig(algorithm_mode="grpo_none")
    assert (grpo.advantage_estimator, grpo.tokens.token_transform) == ("dr_grpo", "none")
    agreeing = from_options(
        RLConfig, {"algorithm_mode": "reinforce_pp_gtpo", "advantage_estimator": "reinforce_pp"}
    )
    assert agreeing.advantages.tokens.token_transform == "gtpo"
    with pytest.raises(ValueError, match="algorithm_mode='maxrl_gtpo' and token_transform="):
        from_options(RLConfig, {"algorithm_mode": "maxrl_gtpo", "token_transform": "gtpo_sepa"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"token_transform": "gtpo_sepaa"}, "did you mean 'gtpo_sepa'"),
        ({"algorithm_mode": "maxrl_gtpo_hicr"}, "did you mean 'maxrl_gtpo_hicra'"),
        ({"uncertainty_kind": "shanon_entropy"}, "did you mean 'shannon_entropy'"),
        ({"advantage_estimator": "reinforce_p"}, "did you mean 'reinforce_pp'"),
        ({"sepa_schedule": "autoo"}, "did you mean 'auto'"),
    ],
)
def test_unknown_names_suggest_the_nearest(options, message):
    with pytest.raises(ValueError, match=message):
        from_options(RLConfig, options)
