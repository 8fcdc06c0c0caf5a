"""Custom losses that tests load by entry point or register by name."""

from __future__ import annotations

from pathlib import Path

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


def loss_distribution(site: Path, entry_points: str) -> Path:
    """A stand-in installed distribution in `site` (put it on sys.path) whose
    `posttrain.losses` entry points are the lines `entry_points`; returns `site`."""
    dist = site / "hand_losses-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hand-losses\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[posttrain.losses]\n{entry_points}")
    return site
