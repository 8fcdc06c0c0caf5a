"""posttrain's attention: SDPA, with bf16 training on the CPU done in float32."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.models import attention
from posttrain.models.load import load_hf_model


def qkv(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shapes = ((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8))  # 4 query heads over 2 KV heads
    return tuple(torch.randn(s, generator=gen).to(dtype) for s in shapes)


class Module(torch.nn.Module):
    """What sdpa_attention_forward reads from an attention layer."""

    is_causal = True
    num_key_value_groups = 2


def test_bf16_with_gradients_runs_in_float32_and_returns_bf16() -> None:
    q, k, v = qkv(torch.bfloat16)
    out, _ = attention.sdpa_float32_training_on_cpu(Module(), q, k, v, None)
    expected, _ = sdpa_attention_forward(Module(), q.float(), k.float(), v.float(), None)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected.to(torch.bfloat16))


def test_a_float_mask_is_upcast_with_the_inputs() -> None:
    q, k, v = qkv(torch.bfloat16)
    mask = torch.zeros(2, 1, 6, 6, dtype=torch.bfloat16)
    mask[..., 0] = float("-inf")  # nobody attends to the first key
    mask[..., 0, :] = 0.0  # ... except the first query, which has nothing else to see
    out, _ = attention.sdpa_float32_training_on_cpu(Module(), q, k, v, mask, is_causal=False)
    expected, _ = sdpa_attention_forward(
        Module(), q.float(), k.float(), v.float(), mask.float(), is_causal=False
    )
    assert torch.equal(out, expected.to(torch.bfloat16))


def test_without_gradients_and_in_float32_nothing_changes() -> None:
    for dtype, grad in ((torch.bfloat16, False), (torch.float32, True), (torch.float32, False)):
        q, k, v = qkv(dtype)
        with torch.set_grad_enabled(grad):
            out, _ = attention.sdpa_float32_training_on_cpu(Module(), q, k, v, None)
            expected, _ = sdpa_attention_forward(Module(), q, k, v, None)
        assert torch.equal(out, expected), (dtype, grad)


def test_models_load_with_it_and_fp32_logits_equal_plain_sdpa(tiny_model_dir: Path) -> None:
    ours = load_hf_model(tiny_model_dir)
    assert ours.config._attn_implementation == attention.NAME
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    plain.eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()  # left padding: a real mask reaches the attention
    assert torch.equal(
        ours(input_ids=ids, attention_mask=mask).logits,
        plain(input_ids=ids, attention_mask=mask).logits,
    )
