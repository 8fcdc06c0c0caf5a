"""Drawing the next token from a decode step's logits: temperature, top-k / top-p truncation,
inverse-CDF draws from given uniforms, and each token's logprob under the untruncated
distribution (`engine.decode.sampler`'s module docstring says why untruncated)."""

from __future__ import annotations

import torch

from posttrain.types import SamplingParams


def choose_tokens(
    logits_AV: torch.Tensor, params: SamplingParams, u_A: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row and its untruncated logprob.

    Draws by inverse CDF from `u_A` (uniforms in [0, 1)); greedy if temperature is 0 or u_A None.
    """
    return draw_tokens(scaled_logits(logits_AV, params, u_A), params, u_A)


def scaled_logits(
    logits_AV: torch.Tensor, params: SamplingParams, u_A: torch.Tensor | None
) -> torch.Tensor:
    """The logits of the distribution tokens are drawn from, before truncation: logits /
    temperature (shifted by the row max), or the logits themselves for greedy."""
    if u_A is None or params.temperature == 0:
        return logits_AV
    # Shifted by the row max, which log_softmax ignores, so that a temperature small enough
    # for logits / temperature to overflow float32 still gives its limit: the max at 0 (0 / 0
    # is set there), every other token at -inf.
    shifted_AV = logits_AV - logits_AV.amax(-1, keepdim=True)
    if params.temperature == 1.0:
        return shifted_AV  # what the division and the where below give, two passes fewer
    return torch.where(shifted_AV == 0, 0.0, shifted_AV / params.temperature)


def draw_tokens(
    scaled_AV: torch.Tensor, params: SamplingParams, u_A: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn from `scaled_logits` (truncated by top-k / top-p), and their logprobs
    under the untruncated distribution."""
    if u_A is None or params.temperature == 0:
        tokens_A = scaled_AV.argmax(-1)
    else:
        tokens_A = _inverse_cdf(truncate_logits(scaled_AV, params.top_k, params.top_p), u_A)
    chosen_A = scaled_AV.gather(1, tokens_A[:, None]).squeeze(1)
    return tokens_A, chosen_A - scaled_AV.logsumexp(-1)


def truncate_logits(logits_AV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k, then outside the top-p nucleus, to -inf (top_k=-1, top_p=1: off)."""
    if 0 < top_k < logits_AV.shape[-1]:
        kth_A1 = logits_AV.topk(top_k, dim=-1).values[:, -1:]
        logits_AV = logits_AV.masked_fill(logits_AV < kth_A1, float("-inf"))
    if top_p < 1.0:
        sorted_AV, order_AV = logits_AV.sort(dim=-1, descending=True)
        probs_AV = sorted_AV.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
        drop_AV = (probs_AV.cumsum(-1) - probs_AV) >= top_p
        drop_AV[:, 0] = False  # the prefix is never empty (a top_p below float32's least does)
        logits_AV = logits_AV.masked_fill(drop_AV.scatter(-1, order_AV, drop_AV), float("-inf"))
    return logits_AV


def _inverse_cdf(logits_AV: torch.Tensor, u_A: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u: a draw from softmax(logits)."""
    # float64 so the cumulative sum over a large vocabulary keeps every token's share.
    cdf_AV = logits_AV.double().softmax(-1).cumsum(-1)
    total_A1 = cdf_AV[:, -1:]
    # x < total strictly, so the chosen token has positive probability (cdf rises there).
    x_A1 = torch.minimum(u_A[:, None] * total_A1, total_A1.nextafter(torch.zeros_like(total_A1)))
    return torch.searchsorted(cdf_AV, x_A1, right=True).squeeze(1)
