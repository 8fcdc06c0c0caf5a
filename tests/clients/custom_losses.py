"""Custom losses that tests load by entry point or register by name."""

from __future__ import annotations

import torch

from posttrain.algo.losses import LossConfig
from posttrain.clients.custom_loss import builtin_as_custom
from posttrain.types import Datum

# ppo with ART's clip range, as the trainer runs loss="ppo" by default.
art_ppo = builtin_as_custom("ppo", LossConfig(epsilon=0.2, epsilon_high=0.2))


def weighted_logprob_sum(
    data: list[Datum], logprobs: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """−Σ w·lp: cross_entropy written by hand."""
    loss = sum(
        (-(d.loss_fn_inputs["weights"] * lp).sum() for d, lp in zip(data, logprobs, strict=True)),
        torch.tensor(0.0),
    )
    return loss, {"custom_metric:mean": 1.5}
