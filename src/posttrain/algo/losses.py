"""Policy and supervised losses, chosen by name from `LOSSES` (Tinker's loss names and semantics).

Every loss is a SUM over tokens and datums: reduction (token mean, sequence mean, ...) is the
caller's choice, expressed by pre-scaling `weights` / `advantages`. This makes the gradient the
same whatever the micro-batch split, the number of forward_backward calls, or the DP size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]
KLEstimator = Literal["k1", "k3"]
KLMode = Literal["loss", "advantage"]


@dataclass(frozen=True)
class LossConfig:
    """Options of the policy losses. `None` thresholds take each loss's default."""

    clip_low_threshold: float | None = None
    clip_high_threshold: float | None = None
    beta: float = 0.05  # dro's quadratic penalty
    importance_sampling_level: ImportanceSamplingLevel = "token"
    truncated_importance_sampling: float | None = None
    mask_prob_ratio: bool = False
    kimi_k2_tau: float | None = None
    kl_penalty_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_mode: KLMode = "loss"
    allow_missing_logprobs: bool = False


@dataclass(frozen=True)
class LossBatch:
    """Padded per-token tensors of one micro-batch; padding has weights 0 and mask 0.

    `logp_BT` is the learner's log p(target) and carries the gradient. `inputs` holds the
    datums' `loss_fn_inputs` padded to [B, T]: `target_tokens`, and as the loss needs them
    `weights`, `advantages`, `logprobs` (behaviour policy), `mask`, `sampler_logprobs`,
    `ref_logprobs`. `entropy_BT` (no gradient) is optional, for diagnostics only.
    """

    logp_BT: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    pad_mask_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOutput:
    """The summed loss (scalar, with gradient) and detached per-token diagnostics [B, T]."""

    loss: torch.Tensor
    per_token: Mapping[str, torch.Tensor] = field(default_factory=lambda: dict[str, torch.Tensor]())


LossFn = Callable[[LossBatch, LossConfig], LossOutput]
