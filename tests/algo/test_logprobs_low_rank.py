"""The output projection's LoRA term applied per chunk (`LowRank`) against W + s B A."""

from __future__ import annotations

import pytest
import torch

from posttrain.algo.logprobs import LowRank, token_logprobs_from_hidden


def inputs(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n, h, v, r = 7, 5, 11, 3
    return {
        "hidden": torch.randn(1, n, h, generator=gen, dtype=dtype),
        "weight": torch.randn(v, h, generator=gen, dtype=dtype),
        "a": torch.randn(r, h, generator=gen, dtype=dtype),
        "b": torch.randn(v, r, generator=gen, dtype=dtype),
        "targets": torch.randint(0, v, (1, n), generator=gen),
    }


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_effective_weight_path(
    chunk_size: int, temperature: float
) -> None:
    """float64, so the two orders of summation agree to 1e-12."""
    scale = 2.5
    x = inputs()
    leaves = {k: x[k].clone().requires_grad_() for k in ("hidden", "a", "b")}
    logp, entropy = token_logprobs_from_hidden(
        leaves["hidden"],
        x["weight"],
        x["targets"],
        lora=LowRank(leaves["a"], leaves["b"], scale),
        chunk_size=chunk_size,
        temperature=temperature,
        with_entropy=True,
    )
    (logp * torch.arange(1.0, 8.0, dtype=torch.float64)).sum().backward()
    naive = {k: x[k].clone().requires_grad_() for k in ("hidden", "a", "b")}
    weight = x["weight"] + scale * naive["b"] @ naive["a"]
    logits = naive["hidden"] @ weight.T / temperature
    expected = logits.log_softmax(-1).gather(-1, x["targets"][..., None]).squeeze(-1)
    (expected * torch.arange(1.0, 8.0, dtype=torch.float64)).sum().backward()
    assert torch.allclose(logp, expected, atol=1e-12, rtol=0)
    probs = logits.softmax(-1)
    assert entropy is not None
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-12, rtol=0)
    for name in ("hidden", "a", "b"):
        got, want = leaves[name].grad, naive[name].grad
        assert got is not None and want is not None
        assert torch.allclose(got, want, atol=1e-12, rtol=0), name


def test_a_frozen_base_weight_gets_no_gradient_and_factors_stay_in_their_dtype() -> None:
    """bf16 base, float32 factors (LoRA on a bf16 model): factor gradients come back float32."""
    x = inputs(torch.float32)
    hidden = x["hidden"].bfloat16().requires_grad_()
    weight = x["weight"].bfloat16()
    a, b = x["a"].requires_grad_(), x["b"].requires_grad_()
    logp, _ = token_logprobs_from_hidden(hidden, weight, x["targets"], lora=LowRank(a, b, 1.0))
    logp.sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.float32
    assert b.grad is not None and b.grad.dtype == torch.float32
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16


def test_factor_shapes_are_checked() -> None:
    x = inputs()
    with pytest.raises(ValueError, match="lora factors must be a_RH"):
        token_logprobs_from_hidden(
            x["hidden"], x["weight"], x["targets"], lora=LowRank(x["a"].T, x["b"], 1.0)
        )
    with pytest.raises(ValueError, match="share their rank and dtype"):
        token_logprobs_from_hidden(
            x["hidden"], x["weight"], x["targets"], lora=LowRank(x["a"][:2], x["b"], 1.0)
        )
