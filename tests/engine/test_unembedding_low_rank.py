"""A LoRA on lm_head through its factors gives the effective-weight path's logprobs and
gradients (that path is forced by making `unembedding_low_rank` decline)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.engine import logprob_pass
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model


def run(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    logp, _ = logprob_pass.target_logprobs(
        model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:], chunk_size=8
    )
    logp.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-5), ("bfloat16", 5e-2)])
def test_factors_match_the_effective_weight(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, tolerance: float
) -> None:
    """fp32: the same sums in another order (measured 1e-6 on logprobs of about -5 and on
    gradients relative to their largest entry). bf16: the fallback rounds W + BA, and the
    [V, H] gradient it passes on to A and B, to bf16; the factors keep the term and its
    gradients in fp32. Measured 5.6e-3 on logprobs and 2.6e-2 on gradients."""
    model = apply_lora(load_hf_model(tiny_model_dir, dtype=dtype), LoraSettings(rank=4), seed=0)
    with torch.no_grad():  # B starts at zero: give the term a value
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    assert logprob_pass.unembedding_low_rank(model) is not None
    logp, grads = run(model)
    monkeypatch.setattr(logprob_pass, "unembedding_low_rank", lambda _model: None)
    logp_ref, grads_ref = run(model)
    assert torch.allclose(logp, logp_ref, atol=tolerance, rtol=0)
    assert grads.keys() == grads_ref.keys() and any("lm_head" in n for n in grads)
    for name, grad in grads.items():
        ref = grads_ref[name].float()
        error = (grad.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
        assert error <= tolerance, (name, float(error))


def test_without_an_active_adapter_the_plain_weight_is_used(tiny_model_dir: Path) -> None:
    model = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=0)
    with logprob_pass.adapters_disabled(model):
        assert logprob_pass.unembedding_low_rank(model) is None
    plain = load_hf_model(tiny_model_dir)
    assert logprob_pass.unembedding_low_rank(plain) is None
