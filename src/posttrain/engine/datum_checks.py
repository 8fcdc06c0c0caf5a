"""Everything a forward or forward_backward call would reject, checked before any compute.

A call that fails after some micro-batches already ran backward would leave their gradients
behind, so the worker checks the whole call first: model limits (token ids, positions), the
loss's config and inputs, and every per-token value the loss validates (a NaN behaviour logprob
on a counted token, bad per-token clip bounds, ...). The value checks run the loss itself with
placeholder learner logprobs on the very micro-batches the pass will give it: each of the
loss's checks reads only the inputs, so this finds exactly what the real pass would, with no
second copy of the rules to drift, and holds one micro-batch at a time, as the pass does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.algo.losses import LossBatch, LossConfig, check_inputs, get_loss
from posttrain.engine.batching import check_same_keys, pad_datums
from posttrain.types import Datum

__all__ = [
    "check_call",
    "check_datums",
    "check_loss_values",
    "check_model_limits",
    "check_same_keys",
]


def check_model_limits(datums: Sequence[Datum], vocab_size: int, max_positions: int) -> None:
    """Token ids inside the vocabulary and sequences within the model's positions."""
    if _within_limits(datums, vocab_size, max_positions):
        return
    for i, datum in enumerate(datums):  # which datum, and what: the first problem in order
        if datum.length > max_positions:
            raise ValueError(
                f"datum {i} has {datum.length} tokens; the model has "
                f"max_position_embeddings={max_positions}"
            )
        ids = torch.tensor(datum.model_input.to_ints())
        for name, tokens in (
            ("model_input", ids),
            ("target_tokens", datum.loss_fn_inputs.get("target_tokens")),
        ):
            if tokens is None:
                continue  # check_inputs names a missing target_tokens
            bad = (tokens < 0) | (tokens >= vocab_size)
            if bool(bad.any()):
                raise ValueError(
                    f"datum {i} {name} has token id {int(tokens[bad][0])} outside the "
                    f"vocabulary [0, {vocab_size})"
                )


def _within_limits(datums: Sequence[Datum], vocab_size: int, max_positions: int) -> bool:
    """Whether `check_model_limits` finds nothing, in a few tensor ops for the whole call: a
    tensor per datum cost 3% of a busy server's compute thread on the tiny model."""
    if any(datum.length > max_positions for datum in datums):
        return False
    ids = [t for datum in datums for t in datum.model_input.to_ints()]
    parts = [torch.tensor(ids, dtype=torch.long)]
    for datum in datums:
        tokens = datum.loss_fn_inputs.get("target_tokens")
        if tokens is not None:
            parts.append(tokens.reshape(-1))
    every = torch.cat(parts)
    return not bool(((every < 0) | (every >= vocab_size)).any())


def check_call(
    datums: Sequence[Datum],
    loss_fn: str,
    config: LossConfig,
    *,
    vocab_size: int,
    max_positions: int,
) -> None:
    """What needs no loss computation: the same keys in every datum, the model's limits, and
    the loss's config and input keys."""
    check_same_keys(datums)
    check_model_limits(datums, vocab_size, max_positions)
    check_inputs(loss_fn, datums[0].loss_fn_inputs.keys(), config)


def check_loss_values(
    datums: Sequence[Datum],
    loss_fn: str,
    config: LossConfig,
    micro_batches: Sequence[Sequence[int]],
) -> None:
    """Run loss `loss_fn` on placeholder logprobs to raise whatever it would raise on `datums`.

    `micro_batches` are the rows of each micro-batch of the real pass, so the loss sees the
    same padded inputs it will see there, and memory stays within the pass's token budget.
    """
    fn = get_loss(loss_fn)
    for rows in micro_batches:
        batch = pad_datums([datums[r] for r in rows])
        logp_BT = torch.zeros(batch.pad_mask_BT.shape)
        fn(LossBatch(logp_BT, batch.inputs, batch.pad_mask_BT), config)


def check_datums(
    datums: Sequence[Datum],
    loss_fn: str,
    config: LossConfig,
    *,
    vocab_size: int,
    max_positions: int,
    micro_batches: Sequence[Sequence[int]],
) -> None:
    """All of the above; raises ValueError naming the datum, field or option at fault."""
    check_call(datums, loss_fn, config, vocab_size=vocab_size, max_positions=max_positions)
    check_loss_values(datums, loss_fn, config, micro_batches)
