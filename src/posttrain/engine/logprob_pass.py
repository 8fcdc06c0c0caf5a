"""Per-token logprobs of target tokens from a causal LM, without materialising [tokens, vocab].

The decoder runs once for hidden states; the output projection and log-softmax run in chunks
through `algo.logprobs`. A LoRA-wrapped unembedding contributes its factors, applied per
chunk as a rank-R term (or, for adapters that are not plain LoRA, its effective weight
W + delta), so gradients reach the adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from posttrain.algo.logprobs import LowRank, token_logprobs_from_hidden
from posttrain.engine.shared_prefix import PrefixGroup, decoder_hidden
from posttrain.models.load import causal_lm, lm_part
from posttrain.models.value_head import is_value_model


def unembedding_weight(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output projection's effective weight [V, H] and bias, LoRA delta included, in the
    base weight's dtype."""
    head: Any = lm_part(causal_lm(model), "get_output_embeddings")  # a PEFT layer's attributes
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight, head.bias
    weight = base.weight
    if not getattr(head, "disable_adapters", False) and not getattr(head, "merged", False):
        for adapter in head.active_adapters:
            if adapter in head.lora_A:
                weight = weight + head.get_delta_weight(adapter)
    # fp32 adapters on a bf16 base: W + delta is summed in fp32, then rounded once to the
    # base's dtype, in which the decoder's hidden states arrive.
    return weight.to(base.weight.dtype), base.bias


def unembedding_low_rank(
    model: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None, LowRank] | None:
    """The output projection as base weight, bias and its LoRA factors, where it has exactly one
    active, unmerged plain LoRA adapter (no DoRA, no dropout); else None."""
    head: Any = lm_part(causal_lm(model), "get_output_embeddings")  # a PEFT layer's attributes
    base = getattr(head, "base_layer", None)
    if base is None or getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return None
    active = [a for a in head.active_adapters if a in head.lora_A]
    if len(active) != 1:
        return None
    (adapter,) = active
    if getattr(head, "use_dora", {}).get(adapter) or not isinstance(
        head.lora_dropout[adapter], nn.Identity
    ):
        return None
    factors = LowRank(
        head.lora_A[adapter].weight, head.lora_B[adapter].weight, float(head.scaling[adapter])
    )
    return base.weight, base.bias, factors


def target_logprobs(
    model: nn.Module,
    input_ids_BT: torch.Tensor,
    pad_mask_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    chunk_size: int,
    with_entropy: bool = False,
    prefix_groups: Sequence[PrefixGroup] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target_t | tokens <= t) for every position, and optionally the entropy.

    For a critic (`models.value_head`) the first tensor is instead V(tokens <= t), the value of
    the state each target is chosen in, and the entropy is None.
    `prefix_groups` (rows sharing leading tokens, `engine.shared_prefix`) run those tokens once.
    """
    lm = causal_lm(model)
    decoder = lm_part(lm, "get_decoder")
    hidden_BTH = decoder_hidden(decoder, input_ids_BT, pad_mask_BT, prefix_groups)
    return head_logprobs(model, hidden_BTH, targets_BT, chunk_size, with_entropy)


def packed_target_logprobs(
    model: nn.Module,
    input_ids_RW: torch.Tensor,
    position_ids_RW: torch.Tensor,
    targets_RW: torch.Tensor,
    *,
    chunk_size: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target_logprobs` of packed rows (`engine.packing`): position ids restart at each
    document and no mask is given, so transformers masks attention block-diagonally. No cache
    either: transformers only looks for packed positions when there is none."""
    decoder = lm_part(causal_lm(model), "get_decoder")
    hidden_RWH = decoder(
        input_ids=input_ids_RW, position_ids=position_ids_RW, use_cache=False
    ).last_hidden_state
    return head_logprobs(model, hidden_RWH, targets_RW, chunk_size, with_entropy)


def head_logprobs(
    model: nn.Module,
    hidden_BTH: torch.Tensor,
    targets_BT: torch.Tensor,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head on the decoder's hidden states: target logprobs (or a critic's values)."""
    lm = causal_lm(model)
    if is_value_model(lm):
        head = lm_part(lm, "get_output_embeddings")
        return head(hidden_BTH.float()).squeeze(-1), None
    low_rank = unembedding_low_rank(model)
    if low_rank is not None:  # LoRA on lm_head: its factors, not a [V, H] W + BA
        weight_VH, bias_V, lora = low_rank
    else:
        (weight_VH, bias_V), lora = unembedding_weight(model), None
    return token_logprobs_from_hidden(
        hidden_BTH,
        weight_VH,
        targets_BT,
        bias_V=bias_V,
        lora=lora,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run a PEFT model as its base model (the KL reference); a no-op for plain models."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        yield
        return
    with disable():
        yield
