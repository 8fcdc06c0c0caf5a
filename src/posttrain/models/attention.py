"""The attention every posttrain model runs: PyTorch's SDPA, with bf16/fp16 training on the CPU
done in float32.

On the CPU, torch's flash-attention kernel is about twice as slow in bfloat16 as in float32
once the backward pass is counted (benchmarks/attention_dtypes.py: 20.1 vs 8.6 ms for a
forward + backward of 32 x 48 tokens, 8 query heads over 4 KV heads, 2 threads), and the
upcast costs less than it saves. So when gradients are recorded, a bf16 or fp16 model's query,
key and value go to float32 for the attention product and its result comes back in the model's
dtype; the linear layers stay in bf16. Sampling (no gradients) keeps the native path: there
the KV cache would be upcast at every decoded token. On any other device nothing changes.

The only difference to `attn_implementation="sdpa"` is that precision (float32 attention rounds
less); tests/engine/test_bf16.py holds bf16 training logprobs to the float32 model's as before.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "posttrain_sdpa"


def sdpa_float32_training_on_cpu(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; in float32 when training a reduced-precision model on CPU."""
    low_precision = query.dtype in (torch.bfloat16, torch.float16)
    if not (low_precision and query.device.type == "cpu" and torch.is_grad_enabled()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # SDPA wants a float mask in the query's dtype
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


def register() -> str:
    """Make `NAME` an attention implementation transformers can load (idempotent)."""
    AttentionInterface.register(NAME, sdpa_float32_training_on_cpu)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
