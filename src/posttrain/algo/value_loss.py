"""The critic's loss for PPO with a learned value function, and how well it explains returns.

Clipped value loss of PPO2 (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
as in OpenAI baselines' ppo2, verl's `compute_value_loss` and OpenRLHF's `ValueLoss`), reduced
as a SUM over tokens like every loss in `algo.losses`: a token mean is weights of 1/N.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from posttrain.algo.loss_inputs import float_input, weight_and_mask
from posttrain.algo.loss_output import LossOutput

if TYPE_CHECKING:
    from posttrain.algo.loss_config import LossBatch, LossConfig

# The critic's loss_fn_inputs, one value per token: the GAE returns it regresses on, and for a
# clipped loss the values before the step's updates with the clip range (a per-token input,
# as the policy losses' clip thresholds travel).
VALUE_INPUTS = ("returns", "old_values", "value_clip")


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    weights_BT: torch.Tensor,
    *,
    clip_eps: float | torch.Tensor | None,
    mask_BT: torch.Tensor | None = None,
) -> LossOutput:
    """Σ_t w_t·ℓ_t with

        v^clip_t = v_old,t + clamp(v_t − v_old,t, −ε_v, ε_v)
        ℓ_t = ½·max((v_t − R_t)², (v^clip_t − R_t)²)      (ℓ_t = ½(v_t − R_t)² if ε_v is None)

    so ∂ℓ_t/∂v_t = v_t − R_t, or 0 where the clipped term is the larger. Counted tokens: mask_BT
    ≠ 0, by default w ≠ 0; uncounted ones add exactly 0 even if their inputs are not finite.
    per_token["value_clipped"] is 1 where the clipped term is strictly the larger (its mean over
    the mask is the clip fraction).
    """
    shapes = {
        name: tuple(t.shape)
        for name, t in (
            ("values", values_BT),
            ("old_values", old_values_BT),
            ("returns", returns_BT),
            ("weights", weights_BT),
        )
    }
    if mask_BT is not None:
        shapes["mask"] = tuple(mask_BT.shape)
    if len(set(shapes.values())) != 1 or len(shapes["values"]) != 2:
        raise ValueError(f"expected [B, T] tensors of one shape, got shapes {shapes}")
    weights_BT = weights_BT.to(values_BT)
    counted_BT = (weights_BT != 0) if mask_BT is None else (mask_BT.to(values_BT.device) != 0)
    _check_clip(clip_eps, counted_BT)
    # Zeroed before any arithmetic, so that a nan on an uncounted token cannot reach the
    # gradient either (0 · nan = nan in the backward pass of a square).
    values_BT = torch.where(counted_BT, values_BT, 0.0)
    returns_BT = torch.where(counted_BT, returns_BT.detach().to(values_BT), 0.0)
    loss_BT = 0.5 * (values_BT - returns_BT).square()
    clipped_BT = torch.zeros_like(counted_BT)
    if clip_eps is not None:
        old_BT = torch.where(counted_BT, old_values_BT.detach().to(values_BT), 0.0)
        # clamp(v, v_old − ε, v_old + ε) is v_old + clamp(v − v_old, −ε, ε) but exactly v inside
        # the range, so rounding never makes an unclipped token look clipped.
        eps = clip_eps.to(values_BT) if isinstance(clip_eps, torch.Tensor) else clip_eps
        clipped_values_BT = torch.clamp(values_BT, old_BT - eps, old_BT + eps)
        clipped_loss_BT = 0.5 * (clipped_values_BT - returns_BT).square()
        clipped_BT = clipped_loss_BT > loss_BT
        # max(), with a tie's gradient all on the unclipped term (torch.maximum splits it).
        loss_BT = torch.where(clipped_BT, clipped_loss_BT, loss_BT)
    loss = (torch.where(counted_BT, weights_BT, 0.0) * loss_BT).sum()
    per_token = {"value_clipped": (clipped_BT & counted_BT).to(values_BT.dtype).detach()}
    return LossOutput(loss=loss, per_token=per_token, mask_BT=counted_BT)


def _check_clip(clip_eps: float | torch.Tensor | None, counted_BT: torch.Tensor) -> None:
    if clip_eps is None:
        return
    if isinstance(clip_eps, torch.Tensor):
        if clip_eps.shape != counted_BT.shape:
            raise ValueError(
                f"a per-token clip_eps must be [B, T] like the values, got "
                f"{tuple(clip_eps.shape)} for {tuple(counted_BT.shape)}"
            )
        eps_N = clip_eps.to(counted_BT.device)[counted_BT].double()
        if not bool(torch.isfinite(eps_N).all() & (eps_N > 0).all()):
            raise ValueError("value_clip must be a finite number > 0 on every counted token")
        return
    if not (math.isfinite(clip_eps) and clip_eps > 0):
        raise ValueError(f"clip_eps must be a finite number > 0 or None, got {clip_eps}")


def value(batch: LossBatch, config: LossConfig) -> LossOutput:
    """The registered loss "value": the critic's clipped value loss on a `LossBatch` whose
    `logp_BT` holds the critic's values (`models.value_head`), from loss_fn_inputs `returns`,
    and for clipping `old_values` with `value_clip` (both or neither); weights and mask as for
    every loss. Diagnostics: `values` and `value_clipped` per token.
    """
    del config  # the clip range travels per token, so a critic call needs no loss options
    weight_BT, mask_BT = weight_and_mask(batch)
    clipped = "value_clip" in batch.inputs
    if clipped != ("old_values" in batch.inputs):
        raise ValueError(
            "the value loss clips with loss_fn_inputs 'old_values' and 'value_clip' together; "
            f"got only {'value_clip' if clipped else 'old_values'}"
        )
    values_BT = batch.logp_BT
    out = value_loss(
        values_BT,
        float_input(batch, "old_values") if clipped else values_BT.detach(),
        float_input(batch, "returns"),
        weight_BT,
        clip_eps=float_input(batch, "value_clip") if clipped else None,
        mask_BT=mask_BT,
    )
    per_token = {**out.per_token, "values": values_BT.detach()}
    return LossOutput(loss=out.loss, per_token=per_token, mask_BT=out.mask_BT)


def explained_variance(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> float:
    """1 − Var[R − V] / Var[R] over the valid tokens of the batch: 1 for a perfect critic, 0 for
    a constant one at the mean return, < 0 when worse. nan when Var[R] = 0 (undefined).
    """
    if values_BT.shape != returns_BT.shape or values_BT.shape != mask_BT.shape:
        raise ValueError(
            f"values, returns and mask must have one shape, got {tuple(values_BT.shape)}, "
            f"{tuple(returns_BT.shape)} and {tuple(mask_BT.shape)}"
        )
    valid_BT = mask_BT.to(values_BT.device) != 0
    # float64: the ratio of two variances of nearly equal vectors loses digits in fp32.
    r_N = returns_BT.detach()[valid_BT].double()
    v_N = values_BT.detach()[valid_BT].double()
    var_returns = float(r_N.var(correction=0)) if r_N.numel() > 0 else 0.0
    if var_returns == 0.0:
        return math.nan
    return 1.0 - float((r_N - v_N).var(correction=0)) / var_returns
