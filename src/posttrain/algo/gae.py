"""Generalized Advantage Estimation for PPO with a learned critic, per token.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation". Each row of a [B, T] batch is one trajectory: its valid tokens (mask ≠ 0), in
order, are its time steps. V_t is the critic's value of the state before token t.
"""

from __future__ import annotations

import math

import torch

from posttrain.algo.token_transforms import whiten


def gae(
    values_BT: torch.Tensor,
    rewards_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages A_BT, returns R_BT), both 0 off the mask and without gradient.

        δ_t = r_t + γ V_{t+1} − V_t        (V after a row's last valid token = 0)
        A_t = Σ_{l≥0} (γλ)^l δ_{t+l} = δ_t + γλ A_{t+1}
        R_t = A_t + V_t

    t+1 is the row's next valid token: a contiguous span (leading prompt zeros, right padding)
    is the usual case, and masked-out tokens inside a row (a tool's output between turns) are
    skipped without discount, as verl does. Values and rewards off the mask are never read, so
    they may be anything, even nan.
    """
    _check_same_shape(values=values_BT, rewards=rewards_BT, mask=mask_BT)
    _check_unit_interval(gamma=gamma, lam=lam)
    values_BT = values_BT.detach()
    valid_BT = mask_BT.to(values_BT.device) != 0
    rewards_BT = rewards_BT.detach().to(values_BT)
    next_value_B = values_BT.new_zeros(values_BT.shape[0])
    next_adv_B = values_BT.new_zeros(values_BT.shape[0])
    adv_columns: list[torch.Tensor] = []
    for t in reversed(range(values_BT.shape[1])):
        valid_B = valid_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        # A masked-out token passes its successor's V and A through unchanged.
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(valid_B, adv_B, next_adv_B)
        adv_columns.append(torch.where(valid_B, adv_B, 0.0))
    adv_BT = torch.stack(adv_columns[::-1], dim=1) if adv_columns else values_BT.clone()
    returns_BT = torch.where(valid_BT, adv_BT + values_BT, 0.0)
    return adv_BT, returns_BT


def whiten_advantages(adv_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(A − μ) / (σ + 1e-8) with μ, σ the mean and population std over the valid tokens of the
    whole batch (`token_transforms.whiten`, as verl and OpenRLHF normalise GAE); 0 off the mask.
    """
    _check_same_shape(adv=adv_BT, mask=mask_BT)
    valid_BT = mask_BT.to(adv_BT.device) != 0
    out_BT = torch.zeros_like(adv_BT)
    out_BT[valid_BT] = whiten(adv_BT[valid_BT])
    return out_BT


def token_rewards(
    rewards_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    kl_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """r_t = 1[t = last valid token of the row]·r_b − β·kl_t on valid tokens, 0 elsewhere.

    The sequence reward sits on the last token, the one whose action ended the sequence; the
    optional per-token KL penalty β·kl_t (e.g. `ratios.kl_estimate`) shapes every valid token.
    Raises ValueError for a row without valid tokens, whose reward would be lost.
    """
    if rewards_B.dim() != 1 or mask_BT.dim() != 2 or rewards_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(
            f"rewards_B must be [B] and mask_BT [B, T] with the same B, got shapes "
            f"{tuple(rewards_B.shape)} and {tuple(mask_BT.shape)}"
        )
    valid_BT = mask_BT.to(rewards_B.device) != 0
    empty = (~valid_BT.any(dim=1)).nonzero()
    if empty.numel() > 0:
        raise ValueError(f"row {int(empty[0].item())} of mask_BT has no valid token for its reward")
    T = valid_BT.shape[1]
    # argmax returns the first maximum, so on the flipped mask it finds the last valid token.
    last_B = T - 1 - valid_BT.flip(1).to(torch.int8).argmax(dim=1)
    out_BT = torch.zeros(valid_BT.shape, dtype=rewards_B.dtype, device=rewards_B.device)
    out_BT[torch.arange(valid_BT.shape[0], device=out_BT.device), last_B] = rewards_B
    if kl_BT is not None:
        _check_same_shape(kl=kl_BT, mask=mask_BT)
        out_BT = out_BT - kl_coef * torch.where(valid_BT, kl_BT.to(out_BT), 0.0)
    return out_BT


def _check_same_shape(**named: torch.Tensor) -> None:
    shapes = {name: tuple(tensor.shape) for name, tensor in named.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"expected [B, T] tensors of one shape, got shapes {shapes}")


def _check_unit_interval(**named: float) -> None:
    for name, x in named.items():
        if not (math.isfinite(x) and 0.0 <= x <= 1.0):
            raise ValueError(f"{name} must be in [0, 1], got {x}")
