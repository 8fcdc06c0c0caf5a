"""What every loss returns (its own module, so the critic's `value_loss` and the policy losses
of `losses` share it without importing each other)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LossOutput:
    """The summed loss (scalar, with gradient), detached per-token diagnostics [B, T], and the
    mask of the tokens the loss counted (for `algo.loss_metrics.summarize`).
    """

    loss: torch.Tensor
    per_token: Mapping[str, torch.Tensor] = field(default_factory=lambda: dict[str, torch.Tensor]())
    mask_BT: torch.Tensor | None = None
