"""A critic: the base causal LM with its unembedding replaced by a scalar value head.

PPO with a learned value function (GAE) needs V(s_t) for every token. The critic is the base
model's decoder with `lm_head` swapped for a Linear(hidden, 1): one value per position, read by
the same pass that gives the policy its logprobs (`logprob_pass.target_logprobs` returns the
values in place of logprobs), so micro-batching, shared prefixes, data-parallel sharding,
checkpoints and offload all serve the critic unchanged.

The head starts at zero (every value 0), so the first GAE advantages are the discounted
rewards, and two critics built from one base model are identical. It is fp32 on any base. With LoRA, the decoder gets
adapters and the head trains whole (PEFT's `modules_to_save`): it is saved in the adapter file.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

VALUE_HEAD_MODULE = "lm_head"  # the attribute the head replaces (Qwen2, Llama, Mistral, ...)
_MARK = "posttrain_value_head"


def to_value_model(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with a zero-initialised scalar head in place of its unembedding (in place)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no linear unembedding to replace with a value head"
        )
    hidden = head.in_features
    # fp32 whatever the base's dtype: with LoRA on a bf16 base the head trains whole, and
    # AdamW's small updates would round away on bf16 weights (the pass feeds it fp32 hidden).
    value = nn.Linear(hidden, 1, bias=True, device=head.weight.device, dtype=torch.float32)
    with torch.no_grad():
        value.weight.zero_()
        assert value.bias is not None
        value.bias.zero_()
    # The head no longer shares the input embedding's weight: untie before swapping, so no
    # later tie_weights() call puts the [vocab, hidden] matrix back.
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", None)
    if callable(text_config):
        setattr(text_config(), "tie_word_embeddings", False)  # noqa: B010 - HF config object
    model.set_output_embeddings(value)
    setattr(model, _MARK, True)
    return model


def is_value_model(model: nn.Module) -> bool:
    """Whether `model` (a causal LM, not its PEFT wrapper) carries a value head."""
    return bool(getattr(model, _MARK, False))
