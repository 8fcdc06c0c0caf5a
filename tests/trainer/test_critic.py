"""PPO with a critic, the step's math: GAE from the critic's values on the exact tokens, the
critic's datums, and the registered value loss with its clip range carried per token."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algo.losses import LossBatch, LossConfig, get_loss
from posttrain.algo.value_loss import value_loss
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.critic import gae_batch
from posttrain.types import Datum, ModelInput


def datum(tokens: list[int], mask: list[float]) -> tuple[Datum, torch.Tensor]:
    mask_T = torch.tensor(mask)
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": torch.zeros(len(mask)),
        "advantages": torch.zeros(len(mask)),
        "mask": mask_T,
    }
    return Datum(ModelInput.from_ints(tokens[:-1]), inputs), mask_T


def test_gae_batch_against_hand_values():
    # Two trajectories. Row 0: prompt target, then 3 sampled tokens, reward 1; row 1: 2
    # sampled tokens, reward 0. gamma = 1, lambda = 1: every return is the episode's reward and
    # A_t = R - V_t.
    #   row 0: V = [_, 0.5, 0.2, 0.1] -> A = [0.5, 0.8, 0.9], R = [1, 1, 1]
    #   row 1: V = [0.3, -0.1]        -> A = [-0.3, 0.1],      R = [0, 0]
    # Whitened over the 5 tokens: mean 0.4, population std sqrt(1.0 / 5).
    d0, m0 = datum([5, 6, 7, 8, 9], [0, 1, 1, 1])
    d1, m1 = datum([5, 6, 7], [1, 1])
    values = [torch.tensor([9.0, 0.5, 0.2, 0.1]), torch.tensor([0.3, -0.1])]
    config = from_options(RLConfig, {"advantage_estimator": "gae", "value_clip": 0.2})
    out = gae_batch([d0, d1], [m0, m1], [1.0, 0.0], values, config)
    raw = [0.5, 0.8, 0.9, -0.3, 0.1]
    mean = sum(raw) / 5
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 5)
    assert std == pytest.approx(math.sqrt(0.2))
    white = [(a - mean) / (std + 1e-8) for a in raw]
    adv0 = out.policy_datums[0].loss_fn_inputs["advantages"]
    adv1 = out.policy_datums[1].loss_fn_inputs["advantages"]
    assert adv0.tolist() == pytest.approx([0.0, *white[:3]], abs=1e-6)
    assert adv1.tolist() == pytest.approx(white[3:], abs=1e-6)
    critic0 = out.critic_datums[0].loss_fn_inputs
    assert critic0["returns"].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])
    assert critic0["old_values"].tolist() == pytest.approx([9.0, 0.5, 0.2, 0.1])
    assert critic0["value_clip"].tolist() == pytest.approx([0.2] * 4)
    assert critic0["mask"].tolist() == [0, 1, 1, 1]
    assert out.critic_datums[1].loss_fn_inputs["returns"].tolist() == [0.0, 0.0]
    # The policy datums keep their tokens and behaviour logprobs; only advantages change.
    assert out.policy_datums[0].model_input.to_ints() == [5, 6, 7, 8]
    assert out.metrics["critic/returns"] == pytest.approx(3 / 5)
    assert out.metrics["critic/advantages_raw"] == pytest.approx(mean)


def test_gae_batch_discounts_and_leaves_out_the_clip_when_asked():
    # gamma 0.5, lambda 1, V = 0: A_t = R_t = 0.5^(T-1-t) * reward.
    d0, m0 = datum([1, 2, 3, 4], [1, 1, 1])
    config = from_options(
        RLConfig, {"advantage_estimator": "gae", "gae_gamma": 0.5, "value_clip": None}
    )
    out = gae_batch([d0], [m0], [2.0], [torch.zeros(3)], config)
    assert out.critic_datums[0].loss_fn_inputs["returns"].tolist() == pytest.approx([0.5, 1.0, 2.0])
    assert "old_values" not in out.critic_datums[0].loss_fn_inputs


def test_gae_batch_refuses_values_of_another_length():
    d0, m0 = datum([1, 2, 3, 4], [1, 1, 1])
    config = from_options(RLConfig, {"advantage_estimator": "gae"})
    with pytest.raises(ValueError, match="2 values for datum 0's 3 targets"):
        gae_batch([d0], [m0], [1.0], [torch.zeros(2)], config)


def test_registered_value_loss_equals_value_loss_with_a_scalar_clip():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 5, generator=gen, requires_grad=True)
    old = values.detach() + 0.3 * torch.randn(2, 5, generator=gen)
    returns = torch.randn(2, 5, generator=gen)
    weights = torch.rand(2, 5, generator=gen)
    inputs = {
        "target_tokens": torch.ones(2, 5, dtype=torch.long),
        "returns": returns,
        "old_values": old,
        "value_clip": torch.full((2, 5), 0.2),
        "weights": weights,
    }
    out = get_loss("value")(LossBatch(values, inputs, torch.ones(2, 5)), LossConfig())
    expected = value_loss(values, old, returns, weights, clip_eps=0.2)
    assert out.loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(out.loss, values)
    (expected_grad,) = torch.autograd.grad(expected.loss, values)
    torch.testing.assert_close(grad, expected_grad)
    assert out.per_token["value_clipped"].sum() > 0  # the case exercises the clip
    # Half of the clip inputs is an error, not an unclipped loss.
    del inputs["value_clip"]
    with pytest.raises(ValueError, match="'old_values' and 'value_clip' together"):
        get_loss("value")(LossBatch(values, inputs, torch.ones(2, 5)), LossConfig())


def test_gae_refuses_a_token_transform():
    with pytest.raises(ValueError, match="token_transform='gtpo' spreads"):
        from_options(RLConfig, {"advantage_estimator": "gae", "token_transform": "gtpo"})
