"""Shannon entropy of each row's sampling distribution, a chunk of rows at a time.

The sampler calls it once per decode step on that step's logits [A, V] (already scaled by the
temperature): the temporaries it adds (log-probabilities, probabilities, their product) cover
at most `chunk_rows` rows, so entropies never cost a [tokens, vocab] tensor beyond the one
decode step's logits the sampler holds anyway.
"""

from __future__ import annotations

import torch

# Rows per chunk: 256 x 32k float32 is 32 MiB per temporary, small beside any model that
# has a 32k vocabulary, and a decode batch is rarely wider.
CHUNK_ROWS = 256


def sampling_entropies(scaled_AV: torch.Tensor, *, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """H_a = -sum_v p_av log p_av with p_a = softmax(scaled_AV[a]), in float32 (or float64), [A].

    -inf logits (a temperature small enough to overflow, masked tokens) have p = 0 and add 0,
    the limit of p log p, rather than 0 * -inf = NaN.
    """
    if scaled_AV.dim() != 2:
        raise ValueError(f"scaled_AV must be [rows, vocab], got shape {tuple(scaled_AV.shape)}")
    if isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    dtype = torch.promote_types(scaled_AV.dtype, torch.float32)
    out_A = torch.empty(scaled_AV.shape[0], dtype=dtype, device=scaled_AV.device)
    for start in range(0, scaled_AV.shape[0], chunk_rows):
        chunk_CV = scaled_AV[start : start + chunk_rows].to(dtype)
        logp_CV = chunk_CV - chunk_CV.logsumexp(-1, keepdim=True)
        p_CV = logp_CV.exp()
        # logp is -inf exactly where p is 0: the term is 0 there.
        terms_CV = torch.where(p_CV > 0, p_CV * logp_CV, 0.0)
        out_A[start : start + chunk_rows] = -terms_CV.sum(-1)
    return out_A
