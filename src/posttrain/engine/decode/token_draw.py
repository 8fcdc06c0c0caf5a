"""Drawing the next token from a decode step's logits: penalties, temperature, min-p / top-k /
top-p truncation, inverse-CDF draws from given uniforms, and each token's logprob under the
untruncated, unpenalized distribution (`engine.decode.sampler`'s module docstring says why).

The order is vLLM's: repetition, frequency and presence penalties on the raw logits, then the
temperature, then min-p, top-k and top-p."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    scaled_AV: torch.Tensor,
    params: SamplingParams,
    u_A: torch.Tensor | None,
    penalized_AV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn from `penalized_AV` (`scaled_logits` of the penalized logits; None: no
    penalty, `scaled_AV`), truncated by min-p / top-k / top-p, and their logprobs under
    `scaled_AV`, the untruncated, unpenalized distribution."""
    drawn_AV = scaled_AV if penalized_AV is None else penalized_AV
    if u_A is None or params.temperature == 0:
        tokens_A = drawn_AV.argmax(-1)
    else:
        kept_AV = truncate_logits(drawn_AV, params.top_k, params.top_p, params.min_p)
        tokens_A = _inverse_cdf(kept_AV, u_A)
    chosen_A = scaled_AV.gather(1, tokens_A[:, None]).squeeze(1)
    return tokens_A, chosen_A - scaled_AV.logsumexp(-1)


def truncate_logits(
    logits_AV: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Set logits below min_p times the likeliest token's probability, then outside the top-k,
    then outside the top-p nucleus, to -inf (min_p=0, top_k=-1, top_p=1: off)."""
    if min_p > 0.0:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); the likeliest stays.
        floor_A1 = logits_AV.amax(-1, keepdim=True) + torch.log(torch.tensor(min_p))
        logits_AV = logits_AV.masked_fill(logits_AV < floor_A1, float("-inf"))
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


def penalized(params: SamplingParams) -> bool:
    """Whether `params` asks for a penalty, so that drawing needs the tokens seen so far."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass
class TokenCounts:
    """Each row's output so far as token counts [A, V], and the tokens its prompt holds [A, V]
    (for the repetition penalty only): what the penalties read."""

    output_AV: torch.Tensor
    prompt_AV: torch.Tensor | None

    @classmethod
    def build(
        cls,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        vocab: int,
        params: SamplingParams,
        device: torch.device,
    ) -> TokenCounts | None:
        """Counts for `num_samples` rows per prompt, or None when `params` has no penalty."""
        if not penalized(params):
            return None
        rows = len(prompts) * num_samples
        output_AV = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        prompt_AV = None
        if params.repetition_penalty != 1.0:
            seen_PV = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
            for i, prompt in enumerate(prompts):
                seen_PV[i, torch.tensor(list(prompt), device=device)] = True
            prompt_AV = seen_PV.repeat_interleave(num_samples, 0)
        return cls(output_AV, prompt_AV)

    def add(self, rows_A: torch.Tensor, tokens_A: torch.Tensor) -> None:
        """Count the tokens just drawn for `rows_A` (each row once)."""
        self.output_AV[rows_A, tokens_A] += 1.0

    def penalize(
        self, logits_AV: torch.Tensor, rows_A: torch.Tensor, params: SamplingParams
    ) -> torch.Tensor:
        """`logits_AV` of `rows_A` with the penalties: a token seen in the prompt or the
        output has a positive logit divided by repetition_penalty and a negative one
        multiplied; each output token's logit loses frequency_penalty per occurrence and
        presence_penalty once."""
        counts_AV = self.output_AV[rows_A]
        if params.repetition_penalty != 1.0:
            seen_AV = counts_AV > 0
            if self.prompt_AV is not None:
                seen_AV |= self.prompt_AV[rows_A]
            r = params.repetition_penalty
            scaled_AV = torch.where(logits_AV > 0, logits_AV / r, logits_AV * r)
            logits_AV = torch.where(seen_AV, scaled_AV, logits_AV)
        if params.frequency_penalty != 0.0:
            logits_AV = logits_AV - params.frequency_penalty * counts_AV
        if params.presence_penalty != 0.0:
            logits_AV = logits_AV - params.presence_penalty * (counts_AV > 0).float()
        return logits_AV
