"""PPO with a learned critic: GAE advantages from a value model, and the critic's updates.

The critic is a second training client (`models.value_head`: the base model with a scalar
head) whose passes return one value per target token where the policy's return logprobs. A step
with `advantage_estimator="gae"`:

1. scores the batch's datums with the critic (one `forward`, before any update): V_t;
2. puts each trajectory's reward on its last trainable token (`algo.gae.token_rewards`) and
   runs GAE (γ, λ) over the trainable tokens: advantages A_t and returns R_t = A_t + V_t;
3. whitens the advantages over the batch's trainable tokens, as verl and OpenRLHF do, and
   gives them to the policy datums per token;
4. beside each policy mini-batch update, updates the critic on the same mini-batch with the
   clipped value loss against R_t (old values V_t, clip `value_clip`), at its own learning rate.

Each trajectory is one episode from its first to its last trainable token; tokens between turns
that the policy did not sample (tool output) are skipped by GAE without discount.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posttrain.algo.gae import gae, token_rewards, whiten_advantages
from posttrain.algo.losses import LossConfig
from posttrain.algo.value_loss import explained_variance
from posttrain.clients.protocol import TrainingClient
from posttrain.trainer.config import RLConfig
from posttrain.trainer.datums import pad_masks
from posttrain.types import AdamParams, Datum, ForwardBackwardOutput

VALUE_LOSS = "value"  # the critic's registered loss (`algo.value_loss.value`)


@dataclass(frozen=True)
class CriticBatch:
    """A step's policy datums with GAE advantages, the critic's datums, and what GAE saw."""

    policy_datums: list[Datum]
    critic_datums: list[Datum]
    metrics: dict[str, float]


def critic_inputs(datum: Datum, mask_T: torch.Tensor) -> Datum:
    """The critic's view of a policy datum: the same tokens, its trainable targets counted."""
    inputs = {"target_tokens": datum.loss_fn_inputs["target_tokens"], "mask": mask_T}
    return Datum(datum.model_input, inputs)


def gae_batch(
    datums: Sequence[Datum],
    masks: Sequence[torch.Tensor],
    rewards: Sequence[float],
    values: Sequence[torch.Tensor],
    config: RLConfig,
) -> CriticBatch:
    """GAE advantages for the policy's datums and returns for the critic's (steps 2-3 above).

    `values[i]` is the critic's value of each target of datum i (its `forward` output), `masks`
    the trainable targets, `rewards` each datum's trajectory reward.
    """
    if not (len(datums) == len(masks) == len(rewards) == len(values)):
        raise ValueError(
            f"got {len(datums)} datums, {len(masks)} masks, {len(rewards)} rewards and "
            f"{len(values)} value rows; expected one of each per datum"
        )
    for i, (v, m) in enumerate(zip(values, masks, strict=True)):
        if v.numel() != m.numel():
            raise ValueError(
                f"the critic returned {v.numel()} values for datum {i}'s {m.numel()} targets"
            )
    mask_BT = pad_masks(list(masks))
    values_BT = pad_masks([v.reshape(-1).float() for v in values])  # zero-padded like the masks
    rewards_BT = token_rewards(torch.tensor(list(rewards), dtype=torch.float32), mask_BT)
    critic = config.critic
    adv_BT, returns_BT = gae(
        values_BT, rewards_BT, mask_BT, gamma=critic.gae_gamma, lam=critic.gae_lambda
    )
    whitened_BT = whiten_advantages(adv_BT, mask_BT)
    policy: list[Datum] = []
    for_critic: list[Datum] = []
    for i, (datum, mask_T) in enumerate(zip(datums, masks, strict=True)):
        length = mask_T.numel()
        inputs = dict(datum.loss_fn_inputs)
        inputs["advantages"] = whitened_BT[i, :length].clone()
        policy.append(Datum(datum.model_input, inputs))
        view = critic_inputs(datum, mask_T)
        critic_in = dict(view.loss_fn_inputs)
        critic_in["returns"] = returns_BT[i, :length].clone()
        if critic.value_clip is not None:
            critic_in["old_values"] = values_BT[i, :length].clone()
            critic_in["value_clip"] = torch.full((length,), critic.value_clip)
        for_critic.append(Datum(view.model_input, critic_in))
    valid = mask_BT != 0
    metrics = {
        "critic/values": float(values_BT[valid].mean()),
        "critic/returns": float(returns_BT[valid].mean()),
        "critic/advantages_raw": float(adv_BT[valid].mean()),
        "critic/explained_variance": explained_variance(values_BT, returns_BT, mask_BT),
    }
    return CriticBatch(policy, for_critic, metrics)


async def score_values(
    critic: TrainingClient, datums: Sequence[Datum], masks: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The critic's value of every target of each datum (step 1), before any update."""
    views = [critic_inputs(d, m) for d, m in zip(datums, masks, strict=True)]
    returns = [torch.zeros(m.numel()) for m in masks]  # read by no value: forward only
    scored = [
        Datum(v.model_input, {**v.loss_fn_inputs, "returns": r})
        for v, r in zip(views, returns, strict=True)
    ]
    out = await critic.forward(scored, VALUE_LOSS, LossConfig())
    return [o["logprobs"].reshape(-1).float().cpu() for o in out.loss_fn_outputs]


def critic_adam(config: RLConfig) -> AdamParams:
    """The critic's optimizer settings: the policy's, at `critic_learning_rate` if given."""
    return config.optimizer.adam_params(config.critic.critic_learning_rate)


async def update_critic(
    critic: TrainingClient, datums: list[Datum], config: RLConfig
) -> tuple[ForwardBackwardOutput, dict[str, float]]:
    """One critic update on a mini-batch whose datums carry the policy's reduction weights."""
    out = await critic.forward_backward(datums, VALUE_LOSS, LossConfig())
    step = await critic.optim_step(critic_adam(config))
    return out, dict(step.metrics or {})
