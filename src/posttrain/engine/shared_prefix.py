"""Shared-prefix passes: rows that start with the same tokens run those tokens once.

An RL batch holds several completions of each prompt. Their prompt tokens give the same hidden
states and keys/values in every row, so the decoder runs each shared prefix once, then runs
every row's own tokens against that prefix's KV cache, repeated once per row. Backward sums the
rows' gradients into the one prefix pass, in a fixed order (`repeat_rows`), so losses and
gradients are those of the unshared pass up to fp32 summation order (~1e-6 relative;
tests/engine/test_shared_prefix.py), and bit-identical run to run at a given thread count. On 8
prompts of ~31 tokens with 8 completions of 16 tokens each, the decoder runs ~1270 tokens
instead of ~3030 (benchmarks/vs_trl.py).

Rows are grouped by sorting them and walking neighbours: a row joins the open group while that
does not lower the tokens the group saves, (rows - 1) x shared length. Every row keeps at least
one token of its own, so the second pass always has a query for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from posttrain.engine.decode.kv_cache import cache_keyword
from posttrain.engine.packing import PackedRows
from posttrain.models.families import LINEAR_CACHE, SLIDING_CACHE
from posttrain.models.lora import has_linear_attention


@dataclass(frozen=True)
class PrefixGroup:
    """Rows (of a call, or positions in a micro-batch) sharing their first `length` tokens."""

    rows: tuple[int, ...]
    length: int  # 0: the rows share nothing and run whole

    @property
    def shared(self) -> bool:
        return self.length > 0 and len(self.rows) > 1


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a call, in batch order, and their prefix groups by position in `rows`."""

    rows: list[int]
    groups: list[PrefixGroup]
    # Set when the rows run packed (`engine.packing`): which of them share each packed row.
    packed: PackedRows | None = None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def find_prefix_groups(rows: Sequence[Sequence[int]], min_length: int) -> list[PrefixGroup]:
    """Partition rows into groups that share >= `min_length` leading tokens (0: no sharing).

    Rows that share nothing come back as one-row groups of length 0; groups are in the order
    of their first rows.
    """
    if min_length < 0:
        raise ValueError(f"min_length must be >= 0 (0 turns sharing off), got {min_length}")
    if min_length == 0 or len(rows) < 2:
        return [PrefixGroup((i,), 0) for i in range(len(rows))]
    order = sorted(range(len(rows)), key=lambda i: tuple(rows[i]))
    groups: list[PrefixGroup] = []
    members = [order[0]]
    length = len(rows[order[0]]) - 1
    for index in order[1:]:
        joined = min(length, common_prefix_length(rows[members[0]], rows[index]))
        joined = min(joined, len(rows[index]) - 1)
        if joined >= min_length and len(members) * joined >= (len(members) - 1) * length:
            members.append(index)
            length = joined
            continue
        groups.extend(_close(members, length))
        members, length = [index], len(rows[index]) - 1
    groups.extend(_close(members, length))
    return sorted(groups, key=lambda g: g.rows[0])


def _close(members: list[int], length: int) -> list[PrefixGroup]:
    if len(members) < 2:
        return [PrefixGroup((members[0],), 0)]
    return [PrefixGroup(tuple(sorted(members)), length)]


def _cost(groups: Sequence[PrefixGroup], lengths: Sequence[int]) -> int:
    """Padded tokens of a micro-batch's passes: the shared prefixes, the rows' own tokens after
    them, and the rows that share nothing (each pass pads its rows to its longest)."""
    shared = [g for g in groups if g.shared]
    own = [lengths[r] - g.length for g in shared for r in g.rows]
    plain = [lengths[r] for g in groups if not g.shared for r in g.rows]
    return (
        len(shared) * max((g.length for g in shared), default=0)
        + len(own) * max(own, default=0)
        + len(plain) * max(plain, default=0)
    )


def plan_micro_batches(
    rows: Sequence[Sequence[int]], budget: int, min_length: int
) -> list[MicroBatch]:
    """Micro-batches of whole prefix groups, longest first, each within `budget` padded tokens.

    A group too large for the budget on its own is cut into parts that each still share the
    prefix. With `min_length=0` this is plain longest-first packing.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    lengths = [len(r) for r in rows]
    units: list[PrefixGroup] = []
    for group in find_prefix_groups(rows, min_length):
        units.extend(_fit(group, lengths, budget))
    units.sort(key=lambda g: (-max(lengths[r] for r in g.rows), g.rows[0]))
    batches: list[list[PrefixGroup]] = []
    for unit in units:
        if batches and _cost([*batches[-1], unit], lengths) <= budget:
            batches[-1].append(unit)
        else:
            batches.append([unit])
    return [_localise(groups) for groups in batches]


def _fit(group: PrefixGroup, lengths: Sequence[int], budget: int) -> list[PrefixGroup]:
    if _cost([group], lengths) <= budget or len(group.rows) == 1:
        return [group]
    half = len(group.rows) // 2
    parts = (group.rows[:half], group.rows[half:])
    return [
        piece
        for part in parts
        for piece in _fit(PrefixGroup(part, group.length if len(part) > 1 else 0), lengths, budget)
    ]


def _localise(groups: list[PrefixGroup]) -> MicroBatch:
    rows = [r for g in groups for r in g.rows]
    position = {r: i for i, r in enumerate(rows)}
    local = [PrefixGroup(tuple(position[r] for r in g.rows), g.length) for g in groups]
    return MicroBatch(rows, local)


def sharing_problem(config: PretrainedConfig) -> str | None:
    """Why shared prefixes are off for a model with this config (its rows then run whole, as
    unshared), or None where its cache is a plain concatenating KV cache to reuse.

    Asked of transformers itself each time (~60 us): a cache keyed by the config's id could
    answer for another model once the config is freed and its address reused.
    """
    layers = DynamicCache(config=config).layers
    if all(type(layer) is DynamicLayer for layer in layers):
        return None
    if has_linear_attention(config):
        return LINEAR_CACHE
    return SLIDING_CACHE


def decoder_hidden(
    decoder: nn.Module,
    input_ids_BT: torch.Tensor,
    pad_mask_BT: torch.Tensor,
    groups: Sequence[PrefixGroup] | None = None,
) -> torch.Tensor:
    """The decoder's last hidden states [B, T, H] for right-padded rows, sharing prefixes."""
    shared = [g for g in groups or () if g.shared]
    config = getattr(decoder, "config", None)
    if not shared or not isinstance(config, PretrainedConfig) or sharing_problem(config):
        return decoder(input_ids=input_ids_BT, attention_mask=pad_mask_BT.long()).last_hidden_state
    lengths = [int(n) for n in pad_mask_BT.sum(1).tolist()]
    hidden: list[torch.Tensor | None] = [None] * len(lengths)
    plain = [r for g in groups or () if not g.shared for r in g.rows]
    if plain:
        index = torch.tensor(plain, device=input_ids_BT.device)
        width = max(lengths[r] for r in plain)
        out = decoder(
            input_ids=input_ids_BT[index, :width],
            attention_mask=pad_mask_BT[index, :width].long(),
        ).last_hidden_state
        for i, row in enumerate(plain):
            hidden[row] = out[i, : lengths[row]]
    for row, states in _shared_pass(decoder, input_ids_BT, lengths, shared):
        hidden[row] = states
    missing = [row for row, h in enumerate(hidden) if h is None]
    if missing:
        raise ValueError(f"prefix groups cover no group for rows {missing}; cover every row once")
    width = input_ids_BT.shape[1]
    return torch.stack([F.pad(h, (0, 0, 0, width - h.shape[0])) for h in hidden if h is not None])


def repeat_rows(x_G: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Row g of `x_G` repeated `counts[g]` times, in order, along dim 0.

    Written as expand + cat rather than `x_G[index]` (what `DynamicCache.batch_select_indices`
    does) so that backward is deterministic: indexing's backward accumulates with parallel
    atomic float adds on CPU when torch has more than one thread, so the prefix's key/value
    gradients, and every weight update after, changed from run to run at 2 threads (~3e-7
    relative per step). An expand's backward is a plain sum.
    """
    return torch.cat([x_G[g : g + 1].expand(n, *x_G.shape[1:]) for g, n in enumerate(counts)])


def _shared_pass(
    decoder: nn.Module,
    input_ids_BT: torch.Tensor,
    lengths: list[int],
    shared: list[PrefixGroup],
) -> list[tuple[int, torch.Tensor]]:
    """Each group's prefix once (with its KV cache), then every member's own tokens on it."""
    device = input_ids_BT.device
    prefix_len = max(g.length for g in shared)
    firsts = torch.tensor([g.rows[0] for g in shared], device=device)
    prefix_mask_GP = (
        torch.arange(prefix_len, device=device)[None, :]
        < torch.tensor([g.length for g in shared], device=device)[:, None]
    ).long()
    padded = bool((prefix_mask_GP == 0).any())
    keyword = cache_keyword(decoder)
    out = decoder(
        input_ids=input_ids_BT[firsts, :prefix_len],
        attention_mask=prefix_mask_GP if padded else None,
        use_cache=True,
    )
    prefix_GPH, cache = out.last_hidden_state, getattr(out, keyword)
    members = [(gi, r) for gi, g in enumerate(shared) for r in g.rows]
    owner = torch.tensor([gi for gi, _ in members], device=device)
    counts = [len(g.rows) for g in shared]
    for layer in cache.layers:
        layer.keys = repeat_rows(layer.keys, counts)
        layer.values = repeat_rows(layer.values, counts)
    starts = [shared[gi].length for gi, _ in members]
    own = [lengths[r] - s for (_, r), s in zip(members, starts, strict=True)]
    width = max(own)
    ids_RS = torch.zeros(len(members), width, dtype=input_ids_BT.dtype, device=device)
    for i, ((_, row), start) in enumerate(zip(members, starts, strict=True)):
        ids_RS[i, : own[i]] = input_ids_BT[row, start : lengths[row]]
    own_mask_RS = (
        torch.arange(width, device=device)[None, :] < torch.tensor(own, device=device)[:, None]
    ).long()
    positions_RS = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)
    mask = torch.cat([prefix_mask_GP[owner], own_mask_RS], dim=1)
    suffix_RSH = decoder(
        input_ids=ids_RS,
        attention_mask=mask if bool((mask == 0).any()) else None,
        position_ids=positions_RS,
        **{keyword: cache},
    ).last_hidden_state
    return [
        (row, torch.cat([prefix_GPH[gi, : starts[i]], suffix_RSH[i, : own[i]]]))
        for i, (gi, row) in enumerate(members)
    ]
