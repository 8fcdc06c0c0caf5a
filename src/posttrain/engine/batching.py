"""Datums to padded tensors, and splitting a batch into micro-batches or data-parallel shards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posttrain.types import Datum


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded tensors for a list of datums; padding is 0 everywhere (so weights are 0)."""

    input_ids_BT: torch.Tensor
    pad_mask_BT: torch.Tensor  # 1.0 on real tokens
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs, each [B, T] (or [B, T, K])
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def check_same_keys(datums: Sequence[Datum]) -> None:
    """Every datum of a call carries the same loss_fn_inputs keys (whatever the split)."""
    if not datums:
        raise ValueError("no datums given: pass at least one Datum")
    keys = set(datums[0].loss_fn_inputs)
    for i, datum in enumerate(datums):
        if set(datum.loss_fn_inputs) != keys:
            raise ValueError(
                f"datum {i} has loss_fn_inputs keys {sorted(datum.loss_fn_inputs)}, but datum 0 "
                f"has {sorted(keys)}; every datum in a call must carry the same keys"
            )


def pad_datums(datums: Sequence[Datum], device: torch.device | str = "cpu") -> PaddedBatch:
    """Stack datums into [B, T] tensors; every datum must carry the same loss_fn_input keys."""
    check_same_keys(datums)
    keys = set(datums[0].loss_fn_inputs)
    lengths = [d.length for d in datums]
    batch, max_len = len(datums), max(lengths)
    input_ids = torch.zeros(batch, max_len, dtype=torch.long)
    pad_mask = torch.zeros(batch, max_len)
    for row, datum in enumerate(datums):
        input_ids[row, : lengths[row]] = torch.tensor(datum.model_input.to_ints())
        pad_mask[row, : lengths[row]] = 1.0
    inputs: dict[str, torch.Tensor] = {}
    for key in sorted(keys):
        first = datums[0].loss_fn_inputs[key]
        padded = first.new_zeros((batch, max_len, *first.shape[1:]))
        for row, datum in enumerate(datums):
            padded[row, : lengths[row]] = datum.loss_fn_inputs[key]
        inputs[key] = padded.to(device)
    return PaddedBatch(input_ids.to(device), pad_mask.to(device), inputs, lengths)


def split_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group consecutive datums so each micro-batch's padded size (rows x longest) fits the budget.

    A datum longer than the budget gets a micro-batch of its own. Order is kept, so results
    gathered back are in the caller's order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        new_longest = max(longest, length)
        if current and new_longest * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, new_longest = [], length
        current.append(index)
        longest = new_longest
    if current:
        groups.append(current)
    return groups


def padded_tokens(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """Tokens computed, padding included: rows x longest row, summed over the groups."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups if g)


def shard_for_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Split datums into `num_ranks` contiguous shards with near-equal token counts.

    Contiguous shards keep gathered results in order. A rank may get no datums when there are
    fewer datums than ranks; sum semantics make that exact.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    total = sum(lengths)
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    seen = 0
    for index, length in enumerate(lengths):
        # Place each datum by where its middle token falls in the cumulative token count.
        rank = min(num_ranks - 1, int((seen + length / 2) * num_ranks / max(total, 1)))
        shards[rank].append(index)
        seen += length
    return shards
