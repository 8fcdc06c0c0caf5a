"""Per-token log-probabilities of target tokens, computed in chunks of tokens.

`token_logprobs_from_hidden` never holds a [tokens, vocab] logits tensor, in forward or in
backward: it recomputes each chunk's logits from the last hidden states and the output
projection (the "fused linear cross-entropy" of Liger-Kernel, Hsu et al. 2024, and of Wijmans
et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"). Peak extra memory is
O(chunk_size x V) instead of O(tokens x V).

Inside this module N = B*T is the flattened token dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch.autograd.function import FunctionCtx, once_differentiable


def token_logprobs(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / τ)[target] per token in float32 (or float64), and the entropy if asked.

    The softmax runs in float32 on `chunk_size` tokens at a time, so no float32 copy of the
    logits is made; only the gradient wrt `logits_BTV` (its own size) is [tokens, vocab].
    Entropy -sum_v p_v log p_v is a detached diagnostic. Non-contiguous logits whose token
    dimensions cannot be flattened as a view (e.g. `logits[:, :-1]`) are copied once.
    """
    _check_options(chunk_size, temperature)
    if logits_BTV.dim() < 2 or logits_BTV.shape[:-1] != targets_BT.shape:
        raise ValueError(
            f"logits_BTV must be targets_BT's shape plus a vocab dimension, got logits_BTV "
            f"{tuple(logits_BTV.shape)} and targets_BT {tuple(targets_BT.shape)}"
        )
    _check_float("logits_BTV", logits_BTV)
    _check_targets(targets_BT, logits_BTV.shape[-1])
    logits_NV = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    targets_N = targets_BT.reshape(-1).long()
    outputs = _LogitsLogprob.apply(logits_NV, targets_N, chunk_size, temperature, with_entropy)  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    return _unflatten(cast(_Outputs, outputs), targets_BT.shape)


class LowRank(NamedTuple):
    """A LoRA term of the output projection: logits += scale * (h @ a_RH.T) @ b_VR.T."""

    a_RH: torch.Tensor
    b_VR: torch.Tensor
    scale: float


def token_logprobs_from_hidden(
    hidden_BTH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    lora: LowRank | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs(hidden @ weight.T + bias, ...)` without ever materialising the logits.

    `lora` adds a low-rank term per chunk, in its factors' dtype (float32 adapters on a bf16
    base), without forming the [V, H] effective weight or its gradient: gradients reach
    a_RH and b_VR through products of rank R, and weight_VH gets none unless it requires one.

    Forward keeps only hidden, weight, bias, targets and the per-token logsumexp; backward
    recomputes each chunk's logits and uses d logp / d logits = (onehot(target) - softmax) / τ.
    The matmuls run in the input dtype (float32 or bfloat16, or autocast's dtype when autocast
    is on, as `lm_head` would) and the softmax in float32. Gradients flow to hidden, weight and
    bias; entropy is detached.
    """
    _check_options(chunk_size, temperature)
    if hidden_BTH.dim() < 2 or hidden_BTH.shape[:-1] != targets_BT.shape:
        raise ValueError(
            f"hidden_BTH must be targets_BT's shape plus a hidden dimension, got hidden_BTH "
            f"{tuple(hidden_BTH.shape)} and targets_BT {tuple(targets_BT.shape)}"
        )
    if weight_VH.dim() != 2 or weight_VH.shape[1] != hidden_BTH.shape[-1]:
        raise ValueError(
            f"weight_VH must be [V, H] with H = hidden_BTH.shape[-1], got weight_VH "
            f"{tuple(weight_VH.shape)} and hidden_BTH {tuple(hidden_BTH.shape)}"
        )
    if bias_V is not None and bias_V.shape != weight_VH.shape[:1]:
        raise ValueError(f"bias_V must be [V] = [{weight_VH.shape[0]}], got {tuple(bias_V.shape)}")
    if torch.is_autocast_enabled(hidden_BTH.device.type):
        # As autocast would for `lm_head`: differentiable casts, so fp32 weights get fp32 grads.
        dtype = torch.get_autocast_dtype(hidden_BTH.device.type)
        hidden_BTH, weight_VH = hidden_BTH.to(dtype), weight_VH.to(dtype)
        bias_V = None if bias_V is None else bias_V.to(dtype)
    for name, tensor in (("hidden_BTH", hidden_BTH), ("weight_VH", weight_VH), ("bias_V", bias_V)):
        if tensor is not None:
            _check_float(name, tensor)
            if tensor.dtype != weight_VH.dtype:
                raise ValueError(
                    f"{name} dtype {tensor.dtype} must match weight_VH dtype {weight_VH.dtype}"
                )
    _check_targets(targets_BT, weight_VH.shape[0])
    if lora is not None:
        _check_low_rank(lora, weight_VH.shape)
    a_RH, b_VR, scale = lora if lora is not None else (None, None, 0.0)
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    targets_N = targets_BT.reshape(-1).long()
    outputs = _HiddenLogprob.apply(  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
        hidden_NH,
        weight_VH,
        bias_V,
        a_RH,
        b_VR,
        scale,
        targets_N,
        chunk_size,
        temperature,
        with_entropy,
    )
    return _unflatten(cast(_Outputs, outputs), targets_BT.shape)


# torch.linalg.vecdot, which torch's stubs leave untyped.
_Binary = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (logp, entropy or None) as the autograd Functions return them.
_Outputs = tuple[torch.Tensor, torch.Tensor | None]
# What _HiddenLogprob saves: hidden_NH, weight_VH, bias_V, a_RH, b_VR (those three may be
# None), targets_N, lse_N.
_SavedHidden = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor,
    torch.Tensor,
]


class _Ctx(FunctionCtx):
    """What forward stores on, and backward reads from, the autograd context (typing only)."""

    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    chunk_size: int
    temperature: float
    scale: float


class _LogitsLogprob(torch.autograd.Function):
    """Chunked log-softmax gather over given logits; saves only logits (an input) and lse."""

    @staticmethod
    def forward(
        ctx: _Ctx,
        logits_NV: torch.Tensor,
        targets_N: torch.Tensor,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats = [
            _chunk_stats(
                _scaled(logits_NV[s:e], temperature, owned=False), targets_N[s:e], with_entropy
            )
            for s, e in _chunks(logits_NV.shape[0], chunk_size)
        ]
        logp_N, lse_N, entropy_N = _concat(stats)
        ctx.save_for_backward(logits_NV, targets_N, lse_N)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        if entropy_N is not None:
            ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: _Ctx, grad_logp_N: torch.Tensor, _grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None]:
        logits_NV, targets_N, lse_N = ctx.saved_tensors
        temperature: float = ctx.temperature
        grad_logits_NV = torch.empty_like(logits_NV)
        for s, e in _chunks(logits_NV.shape[0], ctx.chunk_size):
            grad_logits_NV[s:e] = _grad_logits(
                _scaled(logits_NV[s:e], temperature, owned=False),
                lse_N[s:e],
                targets_N[s:e],
                grad_logp_N[s:e],
                temperature,
            )
        return grad_logits_NV, None, None, None, None


class _HiddenLogprob(torch.autograd.Function):
    """Chunked lm_head (+ a LoRA term) + log-softmax gather; saves the inputs and lse."""

    @staticmethod
    def forward(
        ctx: _Ctx,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        bias_V: torch.Tensor | None,
        a_RH: torch.Tensor | None,
        b_VR: torch.Tensor | None,
        scale: float,
        targets_N: torch.Tensor,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        low_rank = None if a_RH is None or b_VR is None else LowRank(a_RH, b_VR, scale)
        stats = [
            _chunk_stats(
                _chunk_logits(hidden_NH[s:e], weight_VH, bias_V, low_rank, temperature),
                targets_N[s:e],
                with_entropy,
            )
            for s, e in _chunks(hidden_NH.shape[0], chunk_size)
        ]
        logp_N, lse_N, entropy_N = _concat(stats)
        # torch's stub says Tensor, but None is accepted and comes back as None.
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, a_RH, b_VR, targets_N, lse_N)  # pyright: ignore[reportArgumentType]
        ctx.chunk_size, ctx.temperature, ctx.scale = chunk_size, temperature, scale
        if entropy_N is not None:
            ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]
        ctx: _Ctx, grad_logp_N: torch.Tensor, _grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        saved = cast(_SavedHidden, ctx.saved_tensors)
        hidden_NH, weight_VH, bias_V, a_RH, b_VR, targets_N, lse_N = saved
        need_h, need_w, need_b, need_a, need_lora_b = ctx.needs_input_grad[:5]
        temperature: float = ctx.temperature
        low_rank = None if a_RH is None or b_VR is None else LowRank(a_RH, b_VR, ctx.scale)
        grad_a_RH = torch.zeros_like(a_RH) if need_a and a_RH is not None else None
        grad_b_VR = torch.zeros_like(b_VR) if need_lora_b and b_VR is not None else None
        # Weight and bias gradients sum over all chunks: accumulate in float32 even for bf16.
        acc = torch.promote_types(weight_VH.dtype, torch.float32)
        grad_h_NH = torch.empty_like(hidden_NH) if need_h else None
        grad_w_VH = torch.zeros_like(weight_VH, dtype=acc) if need_w else None
        grad_b_V = (
            torch.zeros(weight_VH.shape[0], dtype=acc, device=weight_VH.device) if need_b else None
        )
        for s, e in _chunks(hidden_NH.shape[0], ctx.chunk_size):
            h_CH = hidden_NH[s:e]
            logits_CV = _chunk_logits(h_CH, weight_VH, bias_V, low_rank, temperature)
            g_CV = _grad_logits(
                logits_CV, lse_N[s:e], targets_N[s:e], grad_logp_N[s:e], temperature
            )
            if grad_b_V is not None:
                grad_b_V += g_CV.sum(0)
            lora_h_CH = None
            if low_rank is not None:
                lora_h_CH = _low_rank_grads(h_CH, g_CV, low_rank, grad_a_RH, grad_b_VR, need_h)
            g_CV = g_CV.to(weight_VH.dtype)
            if grad_h_NH is not None:
                torch.mm(g_CV, weight_VH, out=grad_h_NH[s:e])
                if lora_h_CH is not None:
                    grad_h_NH[s:e] += lora_h_CH.to(grad_h_NH.dtype)
            if grad_w_VH is not None and acc == weight_VH.dtype:
                grad_w_VH.addmm_(g_CV.T, h_CH)
            elif grad_w_VH is not None:
                grad_w_VH += (g_CV.T @ h_CH).to(acc)
        grad_w = None if grad_w_VH is None else grad_w_VH.to(weight_VH.dtype)
        grad_b = None if grad_b_V is None else grad_b_V.to(weight_VH.dtype)
        return grad_h_NH, grad_w, grad_b, grad_a_RH, grad_b_VR, None, None, None, None, None


def _chunk_logits(
    h_CH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    low_rank: LowRank | None,
    temperature: float,
) -> torch.Tensor:
    """One chunk's logits / τ in (at least) float32; the low-rank term is added in its own
    dtype's precision, to the logits rather than to the weight."""
    raw_CV = _project(h_CH, weight_VH, bias_V)
    if low_rank is None:
        return _scaled(raw_CV, temperature, owned=True)
    a_RH, b_VR, scale = low_rank
    dtype = torch.promote_types(torch.promote_types(raw_CV.dtype, torch.float32), b_VR.dtype)
    logits_CV = raw_CV.to(dtype)  # a new tensor unless raw_CV (ours) already has the dtype
    u_CR = (h_CH.to(a_RH.dtype) @ a_RH.T).to(dtype)
    logits_CV.addmm_(u_CR, b_VR.T.to(dtype), alpha=scale)
    return logits_CV.div_(temperature) if temperature != 1.0 else logits_CV


def _low_rank_grads(
    h_CH: torch.Tensor,
    g_CV: torch.Tensor,
    low_rank: LowRank,
    grad_a_RH: torch.Tensor | None,
    grad_b_VR: torch.Tensor | None,
    need_h: bool,
) -> torch.Tensor | None:
    """Accumulate one chunk's gradients of the low-rank factors, given g = d loss / d raw
    logits [C, V]; return the term's share of d loss / d h, or None if not needed.

    logits += s (h A^T) B^T, so with u = h A^T:  dB = s g^T u,  dA = s (g B)^T h,
    dh = s (g B) A. Every product has rank R; nothing [V, H] is formed.
    """
    a_RH, b_VR, scale = low_rank
    h_lora_CH = h_CH.to(a_RH.dtype)
    gb_CR = g_CV.to(b_VR.dtype) @ b_VR
    if grad_b_VR is not None:
        grad_b_VR.addmm_(g_CV.T.to(b_VR.dtype), h_lora_CH @ a_RH.T, alpha=scale)
    if grad_a_RH is not None:
        grad_a_RH.addmm_(gb_CR.T, h_lora_CH, alpha=scale)
    return (gb_CR @ a_RH).mul_(scale) if need_h else None


def _check_low_rank(lora: LowRank, weight_shape: torch.Size) -> None:
    vocab, hidden = weight_shape
    a_RH, b_VR, _ = lora
    if a_RH.dim() != 2 or b_VR.dim() != 2 or a_RH.shape[1] != hidden or b_VR.shape[0] != vocab:
        raise ValueError(
            f"lora factors must be a_RH [R, {hidden}] and b_VR [{vocab}, R], got "
            f"{tuple(a_RH.shape)} and {tuple(b_VR.shape)}"
        )
    if a_RH.shape[0] != b_VR.shape[1] or a_RH.dtype != b_VR.dtype:
        raise ValueError(
            f"lora factors must share their rank and dtype, got a_RH {tuple(a_RH.shape)} "
            f"{a_RH.dtype} and b_VR {tuple(b_VR.shape)} {b_VR.dtype}"
        )


def _project(
    h_CH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None
) -> torch.Tensor:
    """One chunk of `lm_head`: h @ W^T + b, in the inputs' dtype."""
    return h_CH @ weight_VH.T if bias_V is None else torch.addmm(bias_V, h_CH, weight_VH.T)


def _scaled(logits_CV: torch.Tensor, temperature: float, *, owned: bool) -> torch.Tensor:
    """Logits of one chunk in (at least) float32, divided by τ; a new tensor unless `owned`."""
    dtype = torch.promote_types(logits_CV.dtype, torch.float32)
    logits_CV = logits_CV.to(dtype, copy=not owned)
    return logits_CV.div_(temperature) if temperature != 1.0 else logits_CV


def _chunk_stats(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp = logit[target] - logsumexp(logits), the logsumexp, and -sum p log p if asked."""
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1) - lse_C
    entropy_C = None
    if with_entropy:
        p_CV = (logits_CV - lse_C.unsqueeze(-1)).exp_()
        if torch.isneginf(logits_CV).any():
            # xlogy(0, 0) = 0, so masked (-inf) logits add 0 rather than 0 * -inf = NaN.
            entropy_C = -torch.xlogy(p_CV, p_CV).sum(-1)
        else:
            # -sum p (z - lse) = lse - sum p z: one dot product per row, not a log and a
            # product per logit.
            vecdot = cast(_Binary, torch.linalg.vecdot)  # pyright: ignore[reportUnknownMemberType]
            dot_C = vecdot(p_CV, logits_CV)
            entropy_C = lse_C - dot_C
    return logp_C, lse_C, entropy_C


def _grad_logits(
    logits_CV: torch.Tensor,
    lse_C: torch.Tensor,
    targets_C: torch.Tensor,
    grad_logp_C: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d loss / d raw logits = grad_logp * (onehot(target) - softmax) / τ, reusing logits_CV."""
    grad_C = grad_logp_C.to(logits_CV.dtype) / temperature
    g_CV = logits_CV.sub_(lse_C.unsqueeze(-1)).exp_().mul_(-grad_C.unsqueeze(-1))
    return g_CV.scatter_add_(-1, targets_C.unsqueeze(-1), grad_C.unsqueeze(-1))


def _chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) bounds covering range(n) in steps of chunk_size; the last may be short.

    n = 0 gives one empty chunk, so empty inputs flow through the same code as any other.
    """
    return [(s, min(s + chunk_size, n)) for s in range(0, max(n, 1), chunk_size)]


def _concat(
    stats: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Join per-chunk (logp, lse, entropy) into [N] tensors."""
    logp_N = torch.cat([s[0] for s in stats])
    lse_N = torch.cat([s[1] for s in stats])
    entropies = [s[2] for s in stats if s[2] is not None]
    return logp_N, lse_N, torch.cat(entropies) if entropies else None


def _unflatten(outputs: _Outputs, shape: torch.Size) -> _Outputs:
    """[N] logp and entropy back to the targets' [B, T] shape."""
    logp_N, entropy_N = outputs
    return logp_N.view(shape), None if entropy_N is None else entropy_N.view(shape)


def _check_options(chunk_size: object, temperature: float) -> None:
    # Typed, but also reached from untyped config: a float chunk size or an infinite
    # temperature (uniform logprobs) would otherwise fail late or silently.
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def _check_targets(targets_BT: torch.Tensor, vocab_size: int) -> None:
    """Token ids must be integers in [0, V): gather would otherwise fail or read garbage."""
    if targets_BT.is_floating_point() or targets_BT.is_complex() or targets_BT.dtype == torch.bool:
        raise ValueError(f"targets_BT must hold integer token ids, got {targets_BT.dtype}")
    bad = targets_BT[(targets_BT < 0) | (targets_BT >= vocab_size)]
    if bad.numel() > 0:
        raise ValueError(
            f"targets_BT holds token id {int(bad[0])} outside [0, {vocab_size}) "
            f"(vocab size {vocab_size})"
        )
