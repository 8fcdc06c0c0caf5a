"""Packed micro-batches: several datums side by side in one row, none attending to another.

Unpacked, a micro-batch pads every datum to its longest, so when lengths vary the decoder
spends much of its work on padding. Packed, datums are laid end to end in rows as wide as the
call's longest datum (first-fit, longest first), each datum's position ids start again at 0,
and the decoder is called with those position ids and no attention mask: transformers then
derives a block-diagonal causal mask from where the positions restart
(`masking_utils.find_packed_sequence_indices`), for `sdpa` and for `posttrain_sdpa` alike
(`models.attention` registers transformers' `sdpa_mask` for it). The row's padding tail starts
again at 0 too, so it is a document of its own that no real token sees.

Rows are as wide as the longest datum, not as the whole token budget: attention costs rows x
width^2, and a budget-wide row (8192 tokens) would make it dominate a small model's pass.

Logprobs (and entropies) come back packed and are scattered into the unpacked [B, T] layout
before the loss, so every loss, per-sequence ones included, sees exactly what it sees
unpacked, and gradients flow back through the scatter. Results equal the unpacked pass up to
fp32 summation order (tests/engine/test_packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posttrain.models.lora import has_linear_attention
from posttrain.types import Datum


def packing_problem(model_config: object) -> str | None:
    """Why datums cannot be packed for a model with this (transformers) config, or None.

    Packing keeps documents apart through attention's mask, which the restarting position ids
    give. A linear-attention layer (Qwen3.5's GatedDeltaNet) has no mask: its convolution and
    recurrent state run on across the row into the next document (measured on the tiny
    Qwen3.5 model: packed logprobs off the unpacked ones by 1.3e-2).
    """
    if has_linear_attention(model_config):
        kind = getattr(model_config, "model_type", "this model")
        return (
            f"packing is refused for {kind}: its linear-attention layers carry their state "
            "from one packed document into the next (no attention mask stops them); train "
            "with packing=False"
        )
    return None


@dataclass(frozen=True)
class PackedRows:
    """Where each datum of a micro-batch sits in its packed rows.

    `rows` lists, per packed row, positions in the micro-batch's datum list, in row order.
    """

    rows: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch's datums packed into [R, W] rows, and the map back to [B, T]."""

    input_ids_RW: torch.Tensor
    position_ids_RW: torch.Tensor
    targets_RW: torch.Tensor
    # For each unpacked position (b, t): its flat index into [R * W], and whether it is real.
    source_BT: torch.Tensor
    real_BT: torch.Tensor

    def unpack(self, packed_RW: torch.Tensor) -> torch.Tensor:
        """Packed per-token values [R, W] as the unpacked [B, T] layout (0 on padding)."""
        gathered = packed_RW.reshape(-1)[self.source_BT]
        # `where`, not a product with the mask: a non-finite value on padding stays out.
        return torch.where(self.real_BT, gathered, torch.zeros_like(gathered))


def plan_packed(lengths: Sequence[int], budget: int) -> list[list[list[int]]]:
    """Micro-batches of packed rows of datum indices: rows of at most the longest datum's
    length, filled first-fit longest first, then as many rows per micro-batch as keep
    rows x widest row within `budget` tokens (at least one row)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if not lengths:
        return []
    width = max(lengths)
    rows: list[list[int]] = []
    filled: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, used in enumerate(filled):
            if used + lengths[index] <= width:
                rows[r].append(index)
                filled[r] += lengths[index]
                break
        else:
            rows.append([index])
            filled.append(lengths[index])
    batches: list[list[list[int]]] = []
    widest = 0
    for row, used in zip(rows, filled, strict=True):
        # Rows come widest first (each opened by a datum no shorter than those after it).
        if batches and (len(batches[-1]) + 1) * max(widest, used) <= budget:
            batches[-1].append(row)
            widest = max(widest, used)
        else:
            batches.append([row])
            widest = used
    return batches


def pack_datums(
    datums: Sequence[Datum], packed: PackedRows, device: torch.device | str = "cpu"
) -> PackedBatch:
    """The datums' tokens, restarting positions and targets, packed as `packed` says."""
    lengths = [d.length for d in datums]
    width = max(sum(lengths[i] for i in row) for row in packed.rows)
    num_rows, longest = len(packed.rows), max(lengths)
    input_ids = torch.zeros(num_rows, width, dtype=torch.long)
    positions = torch.zeros(num_rows, width, dtype=torch.long)
    targets = torch.zeros(num_rows, width, dtype=torch.long)
    source = torch.zeros(len(datums), longest, dtype=torch.long)
    real = torch.zeros(len(datums), longest, dtype=torch.bool)
    for r, row in enumerate(packed.rows):
        start = 0
        for i in row:
            n, end = lengths[i], start + lengths[i]
            input_ids[r, start:end] = torch.tensor(datums[i].model_input.to_ints())
            positions[r, start:end] = torch.arange(n)
            targets[r, start:end] = datums[i].loss_fn_inputs["target_tokens"].long()
            source[i, :n] = r * width + torch.arange(start, end)
            real[i, :n] = True
            start = end
        positions[r, start:] = torch.arange(width - start)  # the tail: a document of its own
    return PackedBatch(
        input_ids.to(device),
        positions.to(device),
        targets.to(device),
        source.to(device),
        real.to(device),
    )
