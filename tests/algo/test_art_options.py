"""ART's option set: its clip defaults pinned, and max_negative_advantage_importance_sampling_weight
by hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import LN2, make_batch

from posttrain.algo.losses import LossConfig, get_loss, resolved_thresholds, with_art_clip_defaults

# ART 0.5 (art/loss.py; docs' option table): ppo epsilon 0.2 and epsilon_high = epsilon; cispo
# epsilon 1.0 and epsilon_high 4.0; each defaults on its own. Written out so a change fails.
ART_RANGES = {"ppo": (0.8, 1.2), "cispo": (0.0, 5.0)}


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_art_clip_defaults_are_arts_documented_values(name):
    assert resolved_thresholds(name, with_art_clip_defaults(name, LossConfig())) == ART_RANGES[name]


def test_each_bound_defaults_on_its_own_as_in_art():
    # ART: epsilon=0.5 alone keeps cispo's epsilon_high 4.0, and is ppo's epsilon_high too.
    assert resolved_thresholds(
        "cispo", with_art_clip_defaults("cispo", LossConfig(epsilon=0.5))
    ) == (
        0.5,
        5.0,
    )
    assert resolved_thresholds("ppo", with_art_clip_defaults("ppo", LossConfig(epsilon=0.5))) == (
        0.5,
        1.5,
    )
    set_both = LossConfig(epsilon=0.1, epsilon_high=0.3)
    assert with_art_clip_defaults("cispo", set_both) == set_both
    # Losses ART does not have keep their own defaults.
    assert with_art_clip_defaults("gspo", LossConfig()) == LossConfig()


def test_max_negative_advantage_cap_applies_to_negative_advantages_only():
    # Two tokens with ratio r = e^{ln 2 · 2}= 4 (lp − q = 2·ln2), advantages −1 and +1, M = 1.5.
    # importance_sampling: ℓ = −r·A. Negative token: r capped at 1.5 → ℓ = 1.5, and the clamp
    # cuts its gradient (d min(r, M)/dr = 0 above M). Positive token: uncapped, ℓ = −4,
    # dℓ/dlp = −r·A = −4. Sum 1.5 − 4 = −2.5.
    rows = [{"lp": [0.0, 0.0], "logprobs": [-2 * LN2, -2 * LN2], "advantages": [-1.0, 1.0]}]
    batch, lp = make_batch(rows, ["logprobs", "advantages"])
    config = LossConfig(max_negative_advantage_importance_sampling_weight=1.5)
    out = get_loss("importance_sampling")(batch, config)
    assert out.loss.item() == pytest.approx(-2.5, rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad[0].tolist() == pytest.approx([0.0, -4.0], rel=1e-12)
    # Without the cap the negative token gives ℓ = 4 (sum 0) and gradient 4.
    plain = get_loss("importance_sampling")(batch, LossConfig())
    assert plain.loss.item() == pytest.approx(0.0, abs=1e-12)


def test_the_cap_must_be_positive():
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="max_negative_advantage_importance_sampling_weight"):
            LossConfig(max_negative_advantage_importance_sampling_weight=bad)
    with pytest.raises(ValueError, match="does not use"):
        get_loss("dro")(
            *_dro_batch(), LossConfig(max_negative_advantage_importance_sampling_weight=2.0)
        )


def _dro_batch():
    batch, _ = make_batch(
        [{"lp": [0.0], "logprobs": [0.0], "advantages": [1.0]}], ["logprobs", "advantages"]
    )
    return (batch,)
