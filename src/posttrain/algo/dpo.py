"""Preference losses on (chosen, rejected) pairs: DPO's sigmoid loss and IPO, from `PAIR_LOSSES`.

Per pair, with π the policy and π_ref the reference, each summed over its completion's tokens:

    logratio = (log π(y_c|x) − log π_ref(y_c|x)) − (log π(y_r|x) − log π_ref(y_r|x))
    sigmoid (DPO, Rafailov et al. 2023):  ℓ = −log σ(β · logratio)
    ipo     (IPO, Azar et al. 2023):      ℓ = (logratio − 1/(2β))²

IPO here is computed, as TRL does, on per-token AVERAGED sequence logprobs (each completion's
Σ_t lp_t / |y|): the 1/(2β) target margin then does not depend on the completions' lengths.
The sigmoid loss uses the plain sums, as the DPO paper. The implicit rewards reported are
β·(log π − log π_ref) of each completion, on the same (summed or averaged) logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "AVERAGES_TOKENS",
    "PAIR_LOSSES",
    "PairLoss",
    "PairLossOutput",
    "ipo_loss",
    "pair_loss",
    "sequence_logp",
    "sigmoid_loss",
]

PairLoss = Literal["sigmoid", "ipo"]


def sigmoid_loss(logratio_B: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): ℓ = −log σ(β · logratio), per pair."""
    return -F.logsigmoid(beta * logratio_B)


def ipo_loss(logratio_B: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): ℓ = (logratio − 1/(2β))², per pair."""
    return (logratio_B - 1.0 / (2.0 * beta)) ** 2


PAIR_LOSSES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "sigmoid": sigmoid_loss,
    "ipo": ipo_loss,
}
# Whether a loss reads each completion's per-token mean logprob instead of its sum.
AVERAGES_TOKENS: dict[str, bool] = {"sigmoid": False, "ipo": True}


def sequence_logp(logp_T: torch.Tensor, mask_T: torch.Tensor, average: bool) -> torch.Tensor:
    """Σ_t m_t·lp_t over a completion's tokens, divided by Σ_t m_t when `average`."""
    total = (logp_T * mask_T).sum()
    return total / mask_T.sum() if average else total


@dataclass(frozen=True)
class PairLossOutput:
    """Per-pair loss ℓ_B and implicit rewards β·(log π − log π_ref) of each completion."""

    loss_B: torch.Tensor
    chosen_rewards_B: torch.Tensor
    rejected_rewards_B: torch.Tensor

    def metric_sums(self) -> dict[str, float]:
        """Sums over the pairs (the caller divides by their number): rewards, accuracy, margin."""
        chosen, rejected = self.chosen_rewards_B.detach(), self.rejected_rewards_B.detach()
        return {
            "rewards/chosen": float(chosen.sum()),
            "rewards/rejected": float(rejected.sum()),
            "rewards/accuracy": float((chosen > rejected).float().sum()),
            "rewards/margin": float((chosen - rejected).sum()),
        }


def pair_loss(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    ref_chosen_B: torch.Tensor,
    ref_rejected_B: torch.Tensor,
    beta: float,
    loss: PairLoss,
) -> PairLossOutput:
    """Loss `loss` of `PAIR_LOSSES` per pair, from sequence logprobs (see `sequence_logp`)."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_B = policy_chosen_B - ref_chosen_B
    rejected_B = policy_rejected_B - ref_rejected_B
    return PairLossOutput(
        loss_B=PAIR_LOSSES[loss](chosen_B - rejected_B, beta),
        chosen_rewards_B=beta * chosen_B,
        rejected_rewards_B=beta * rejected_B,
    )
