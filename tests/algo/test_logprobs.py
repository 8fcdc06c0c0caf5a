"""Tests for chunked token logprobs: values, gradients, memory bound, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.algo.logprobs import token_logprobs, token_logprobs_from_hidden


def _reference(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unchunked: the whole [B, T, V] log_softmax at once, then gather."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    return logp_BT, -(logp_BTV.exp() * logp_BTV).sum(-1)


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, scale: float) -> None:
    """|actual - expected| <= 1e-6 * scale, with `scale` from `_term_scales`."""
    err = (actual - expected).abs().max().item()
    assert err <= 1e-6 * scale, f"max abs error {err:.3g} > 1e-6 * {scale:.3g}"


def _term_scales(
    hidden_BTH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor,
    targets_BT: torch.Tensor,
    grad_out_BT: torch.Tensor,
    temperature: float,
) -> dict[str, float]:
    """Error scales of each output: its formula evaluated on absolute values of the terms.

    A float32 sum is exact to a few ulps of the sum of its terms' magnitudes (Higham), not
    of its result, and chunking only reorders sums (the matmul's over H, the gradients' over
    tokens). A logit is exact to ulps of L = sum_h |h||w| + |b| (over τ); logp = logit - lse
    cancels numbers of that size; p = exp(logit - lse) so carries a relative error ~ulp(L),
    which multiplies every gradient term by (1 + L). Over 4,000 random cases the largest
    error was 0.31e-6 of these scales, so 1e-6 is tight without being flaky.
    """
    h_NH, w_VH = hidden_BTH.detach().flatten(0, 1), weight_VH.detach()
    logits_NV = torch.addmm(bias_V.detach(), h_NH, w_VH.T) / temperature
    logit_terms = (torch.addmm(bias_V.detach().abs(), h_NH.abs(), w_VH.abs().T)) / temperature
    big_l = logit_terms.max().item()
    p_NV = torch.softmax(logits_NV, dim=-1)
    onehot_NV = torch.nn.functional.one_hot(targets_BT.flatten(), w_VH.shape[0]).float()
    # |d loss / d logits| <= |grad_out| (onehot + p) / τ, termwise.
    a_NV = (grad_out_BT.flatten().abs() / temperature).unsqueeze(-1) * (onehot_NV + p_NV)
    logp_scale = big_l + torch.logsumexp(logits_NV, -1).abs().max().item()
    return {
        "logp": logp_scale,
        "entropy": logp_scale,
        "logits": a_NV.max().item() * (1 + big_l),
        "hidden": (a_NV @ w_VH.abs()).max().item() * (1 + big_l),
        "weight": (a_NV.T @ h_NH.abs()).max().item() * (1 + big_l),
        "bias": a_NV.sum(0).max().item() * (1 + big_l),
    }


def test_hand_derived_values() -> None:
    # logits [0, log 3]: exp -> [1, 3], sum 4, p = [1/4, 3/4].
    # logp(target=1) = log 0.75 ≈ -0.28768; entropy = -(0.25 log 0.25 + 0.75 log 0.75)
    # = 0.25 * 1.38629 + 0.75 * 0.28768 = 0.34657 + 0.21576 = 0.56233.
    expected_entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert expected_entropy == pytest.approx(0.5623, abs=1e-4)
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)
    targets = torch.tensor([[1]])
    logp, entropy = token_logprobs(logits, targets, with_entropy=True)
    assert entropy is not None
    assert logp.item() == pytest.approx(math.log(0.75), rel=1e-12)
    assert entropy.item() == pytest.approx(expected_entropy, rel=1e-12)
    # The same logits from hidden h = [1] and W = [[0], [log 3]] (logit_v = h · w_v).
    weight = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64)
    hidden = torch.ones(1, 1, 1, dtype=torch.float64)
    logp_h, entropy_h = token_logprobs_from_hidden(hidden, weight, targets, with_entropy=True)
    assert entropy_h is not None
    assert logp_h.item() == pytest.approx(math.log(0.75), rel=1e-12)
    assert entropy_h.item() == pytest.approx(expected_entropy, rel=1e-12)
    # Temperature 2 on logits [0, 2 log 3] divides them back to [0, log 3]: same p.
    logp_t, _ = token_logprobs(2 * logits, targets, temperature=2.0)
    assert logp_t.item() == pytest.approx(math.log(0.75), rel=1e-12)


def test_hand_derived_gradient() -> None:
    # d logp_target / d logit_v = (onehot(target) - p) / τ: with p = [1/4, 3/4], target 1,
    # τ = 1: [-0.25, 0.25].
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64, requires_grad=True)
    logp, _ = token_logprobs(logits, torch.tensor([[1]]))
    logp.sum().backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]], dtype=torch.float64))


@settings(max_examples=20, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 6),
    h=st.integers(1, 5),
    v=st.integers(1, 9),
    with_bias=st.booleans(),
    temperature=st.floats(0.5, 2.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_naive_per_token_loop(
    b: int, t: int, h: int, v: int, with_bias: bool, temperature: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64) if with_bias else None
    targets = torch.randint(0, v, (b, t), generator=gen)
    logp, entropy = token_logprobs_from_hidden(
        hidden,
        weight,
        targets,
        bias_V=bias,
        chunk_size=2,
        temperature=temperature,
        with_entropy=True,
    )
    assert entropy is not None
    for i in range(b):
        for j in range(t):
            logits = [
                (
                    sum(hidden[i, j, k].item() * weight[u, k].item() for k in range(h))
                    + (bias[u].item() if bias is not None else 0.0)
                )
                / temperature
                for u in range(v)
            ]
            lse = math.log(sum(math.exp(x) for x in logits))
            p = [math.exp(x - lse) for x in logits]
            # float64 throughout: agreement to ~1e-12, far below any fp32 effect.
            assert logp[i, j].item() == pytest.approx(
                logits[targets[i, j]] - lse, rel=1e-12, abs=1e-12
            )
            assert entropy[i, j].item() == pytest.approx(
                -sum(q * math.log(q) for q in p if q > 0), rel=1e-12, abs=1e-12
            )


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 24),
    h=st.integers(1, 16),
    v=st.integers(2, 64),
    chunk_size=st.integers(1, 40),
    temperature=st.floats(0.3, 3.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_matches_unchunked_fp32(
    b: int, t: int, h: int, v: int, chunk_size: int, temperature: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    bias = torch.randn(v, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (b, t), generator=gen)
    # Random upstream weights, as a policy loss would give (advantages times weights).
    grad_out = torch.randn(b, t, generator=gen)
    params = (hidden, weight, bias)

    logits = torch.addmm(bias, hidden.reshape(-1, h), weight.T).reshape(b, t, v)
    ref_logp, ref_entropy = _reference(logits, targets, temperature)
    ref_grads = torch.autograd.grad((ref_logp * grad_out).sum(), params)

    logp, entropy = token_logprobs_from_hidden(
        hidden, weight, targets, bias_V=bias, chunk_size=chunk_size,
        temperature=temperature, with_entropy=True,
    )  # fmt: skip
    assert entropy is not None and not entropy.requires_grad
    grads = torch.autograd.grad((logp * grad_out).sum(), params)
    scales = _term_scales(hidden, weight, bias, targets, grad_out, temperature)
    _assert_close_rel(logp, ref_logp, scales["logp"])
    _assert_close_rel(entropy, ref_entropy.detach(), scales["entropy"])
    for name, grad, ref_grad in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        _assert_close_rel(grad, ref_grad, scales[name])

    # From logits: the gradient wrt logits matches autograd through log_softmax.
    leaf = logits.detach().requires_grad_()
    ref_leaf_logp, _ = _reference(leaf, targets, temperature)
    (ref_leaf_grad,) = torch.autograd.grad((ref_leaf_logp * grad_out).sum(), leaf)
    logp_l, entropy_l = token_logprobs(
        leaf, targets, chunk_size=chunk_size, temperature=temperature, with_entropy=True
    )
    assert entropy_l is not None
    (leaf_grad,) = torch.autograd.grad((logp_l * grad_out).sum(), leaf)
    _assert_close_rel(logp_l, ref_logp, scales["logp"])
    _assert_close_rel(entropy_l, ref_entropy.detach(), scales["entropy"])
    _assert_close_rel(leaf_grad, ref_leaf_grad, scales["logits"])


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    # chunk_size 4 does not divide the 6 tokens: the short last chunk is exercised.
    assert torch.autograd.gradcheck(
        lambda h, w, b: token_logprobs_from_hidden(
            h, w, targets, bias_V=b, chunk_size=4, temperature=0.7
        )[0],
        (hidden, weight, bias),
    )
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, targets, chunk_size=4, temperature=1.3)[0], (logits,)
    )


class _LargestTensor(TorchDispatchMode):
    """Records the largest numel among tensors that ops (other than views) produce while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view allocates nothing
            return out
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_from_hidden_never_materialises_tokens_by_vocab() -> None:
    b, t, h, v, chunk = 2, 32, 4, 50, 16  # N = 64 tokens; N*V = 3200, chunk*V = 800
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    bias = torch.randn(v, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (b, t), generator=gen)
    with _LargestTensor() as mode:
        logp, entropy = token_logprobs_from_hidden(
            hidden, weight, targets, bias_V=bias, chunk_size=chunk, with_entropy=True
        )
        assert entropy is not None
        (logp.sum() + entropy.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None
    # Other tensors (grad_W: V*H = 200, grad_h: N*H = 256) are smaller than one chunk.
    assert mode.largest <= chunk * v < b * t * v
    # The unchunked path does build [N, V] tensors: the probe sees them.
    with _LargestTensor() as mode:
        logits = hidden @ weight.T + bias
        _reference(logits, targets, 1.0)[0].sum().backward()
    assert mode.largest >= b * t * v


def test_from_logits_forward_makes_no_tokens_by_vocab_copy() -> None:
    # bf16 logits: an unchunked float32 upcast would create an [N, V] tensor.
    logits = torch.randn(2, 32, 50).bfloat16()
    targets = torch.randint(0, 50, (2, 32))
    with _LargestTensor() as mode:
        token_logprobs(logits, targets, chunk_size=8, with_entropy=True)
    assert mode.largest <= 8 * 50


def test_logits_input_is_not_modified() -> None:
    # fp32 at temperature 1 is the case where a chunk could alias the caller's logits.
    logits = torch.randn(3, 5, 7, requires_grad=True)
    before = logits.detach().clone()
    targets = torch.randint(0, 7, (3, 5))
    logp, _ = token_logprobs(logits, targets, chunk_size=4)
    logp.sum().backward()
    assert torch.equal(logits.detach(), before)


def test_bfloat16_matches_unchunked_bfloat16() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(40, 16, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 40, (2, 9), generator=gen)
    logp, _ = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=4)
    logp.sum().backward()
    ref_logp, _ = _reference(hidden.detach() @ weight.detach().T, targets, 1.0)
    assert logp.dtype == torch.float32
    assert hidden.grad is not None and hidden.grad.dtype == torch.bfloat16
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    # Logits of size ~|h|·|w| ~ 16 rounded to bf16 (8 bits) may differ by one ulp (0.0625)
    # between chunked and whole matmuls; logp inherits that absolute error.
    torch.testing.assert_close(logp, ref_logp, rtol=0.0, atol=0.07)


def test_autocast_casts_like_lm_head() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (2, 9), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs_from_hidden(hidden, weight.detach().bfloat16(), targets)
        logp.sum().backward()
        ref_logp, _ = _reference(hidden.detach() @ weight.detach().T, targets, 1.0)
    assert hidden.grad is not None and hidden.grad.dtype == torch.float32
    # Same bf16 logits rounding argument as test_bfloat16_matches_unchunked_bfloat16.
    torch.testing.assert_close(logp, ref_logp, rtol=0.0, atol=0.07)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        token_logprobs_from_hidden(hidden, weight, targets)[0].sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_frozen_weight_gets_no_gradient() -> None:
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(6, 4)
    targets = torch.randint(0, 6, (2, 3))
    logp, _ = token_logprobs_from_hidden(hidden, weight, targets, chunk_size=4)
    logp.sum().backward()
    (ref_grad,) = torch.autograd.grad(_reference(hidden @ weight.T, targets, 1.0)[0].sum(), hidden)
    assert hidden.grad is not None and weight.grad is None
    # Chunking reorders no sum that feeds hidden's gradient here; fp32 ulps of |W| ~ 1e-7.
    torch.testing.assert_close(hidden.grad, ref_grad, rtol=1e-6, atol=1e-6)


def test_masked_logits_give_finite_entropy() -> None:
    # A -inf logit has p = 0; 0 * log 0 counts as 0, so p = [1/2, 1/2, 0]: entropy log 2.
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]])
    logp, entropy = token_logprobs(logits, torch.tensor([[0]]), with_entropy=True)
    assert entropy is not None
    assert logp.item() == pytest.approx(-math.log(2.0), rel=1e-6)
    assert entropy.item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_empty_batch() -> None:
    logp, entropy = token_logprobs_from_hidden(
        torch.randn(0, 3, 4), torch.randn(5, 4), torch.zeros(0, 3, dtype=torch.long),
        with_entropy=True,
    )  # fmt: skip
    assert logp.shape == (0, 3) and entropy is not None and entropy.shape == (0, 3)


def test_bad_inputs() -> None:
    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
    targets = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden_BTH.*\(2, 3, 4\).*targets_BT.*\(2, 2\)"):
        token_logprobs_from_hidden(hidden, weight, targets[:, :2])
    with pytest.raises(ValueError, match=r"weight_VH.*\(5, 3\)"):
        token_logprobs_from_hidden(hidden, torch.randn(5, 3), targets)
    with pytest.raises(ValueError, match=r"bias_V must be \[V\] = \[5\], got \(4,\)"):
        token_logprobs_from_hidden(hidden, weight, targets, bias_V=torch.randn(4))
    with pytest.raises(ValueError, match=r"hidden_BTH dtype torch.bfloat16"):
        token_logprobs_from_hidden(hidden.bfloat16(), weight, targets)
    for bad_chunk in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"chunk_size must be an int >= 1, got {bad_chunk}"):
            token_logprobs_from_hidden(hidden, weight, targets, chunk_size=bad_chunk)  # pyright: ignore[reportArgumentType]
    for bad_temperature in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"temperature must be a finite number > 0"):
            token_logprobs_from_hidden(hidden, weight, targets, temperature=bad_temperature)
        with pytest.raises(ValueError, match=r"temperature must be a finite number > 0"):
            token_logprobs(torch.randn(2, 3, 5), targets, temperature=bad_temperature)
    for bad_id in (5, -1):
        bad_targets = targets.clone()
        bad_targets[1, 2] = bad_id
        with pytest.raises(
            ValueError, match=rf"token id {bad_id} outside \[0, 5\) \(vocab size 5\)"
        ):
            token_logprobs_from_hidden(hidden, weight, bad_targets)
        with pytest.raises(ValueError, match=rf"token id {bad_id} outside \[0, 5\)"):
            token_logprobs(torch.randn(2, 3, 5), bad_targets)
    with pytest.raises(ValueError, match=r"targets_BT must hold integer token ids"):
        token_logprobs(torch.randn(2, 3, 5), targets.float())
    with pytest.raises(ValueError, match=r"logits_BTV.*\(2, 3\).*targets_BT.*\(2, 3\)"):
        token_logprobs(torch.randn(2, 3), targets)
    with pytest.raises(ValueError, match=r"logits_BTV must be a floating-point tensor"):
        token_logprobs(torch.zeros(2, 3, 5, dtype=torch.long), targets)
