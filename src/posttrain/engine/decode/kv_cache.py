"""KV caches: a sampling cache that writes in place into growing buffers, the keyword by which
a model's forward takes one, and the row operations the sampler runs on a cache of any kind.

transformers' DynamicCache concatenates (copies) the whole cache at every decoding step; this
layer writes each step's keys and values into spare positions instead. A hybrid model's
linear-attention layers (Qwen3.5's GatedDeltaNet) hold a convolution and a recurrent state
per row instead of keys and values: `repeat_rows` and `select_rows` carry those along with the
KV layers', so a prompt's state is computed once and repeated per sample, and a finished row
leaves every layer.
"""

from __future__ import annotations

import functools
import inspect
from typing import Literal

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

try:  # transformers >= 5.2x: the caches of linear-attention (hybrid) layers
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # an older transformers has no hybrid models, so no such layer
    LinearAttentionCacheLayerMixin = None

# Spare positions the KV cache reserves beyond the prompt at first (it doubles when full).
_CACHE_STEP = 256


CacheKeyword = Literal["cache", "past_key_values"]


def cache_keyword(module: nn.Module) -> CacheKeyword:
    """The keyword by which `module`'s forward (a transformers model, or a PEFT wrapper of
    one) takes and returns its KV cache.

    transformers 5.2x renamed `past_key_values` to `cache` (5.24 warns at every call that still
    passes the old name; 5.40 removes it), and 5.17 knows only `past_key_values`. Asked of the
    forward's signature, because a model whose forward takes `**kwargs` drops a keyword it does
    not know without a word: the cache would silently go unused.
    """
    get_base = getattr(module, "get_base_model", None)
    base = get_base() if callable(get_base) else module
    return _keyword_of(type(base))


@functools.cache
def _keyword_of(cls: type) -> CacheKeyword:
    parameters = inspect.signature(cls.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise TypeError(f"{cls.__name__}.forward takes no KV cache (neither cache nor past_key_values)")


def preallocated_cache(model: nn.Module, max_length: int) -> DynamicCache:
    """A DynamicCache whose full-attention layers write in place into growing buffers."""
    cache = DynamicCache(config=getattr(model, "config"))  # noqa: B009
    cache.layers = [
        PreallocatedLayer(max_length) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


def repeat_rows(cache: Cache, repeats: int) -> None:
    """Each row of every layer's cache `repeats` times in a row (a prompt's, per sample)."""
    for layer in cache.layers:
        if _is_linear(layer):
            rows = _linear_rows(layer)
            if rows is not None:
                _reorder_linear(layer, rows.repeat_interleave(repeats))
        repeat = getattr(layer, "batch_repeat_interleave", None)  # a layer with keys and values
        if repeat is not None:
            repeat(repeats)


def select_rows(cache: Cache, indices: torch.Tensor) -> None:
    """Keep the rows `indices` of every layer's cache (finished rows leave the batch)."""
    for layer in cache.layers:
        if _is_linear(layer):
            _reorder_linear(layer, indices)
        select = getattr(layer, "batch_select_indices", None)
        if select is not None:
            select(indices)


def _is_linear(layer: object) -> bool:
    return LinearAttentionCacheLayerMixin is not None and isinstance(
        layer, LinearAttentionCacheLayerMixin
    )


def _reorder_linear(layer: object, rows: torch.Tensor) -> None:
    """A linear-attention layer's convolution and recurrent states, rows `rows` of them (as its
    own `reorder_cache`, which a layer that also holds keys and values may override)."""
    for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
        for index, state in states.items():
            if state is not None:
                states[index] = state.index_select(0, rows.to(state.device))


def _linear_rows(layer: object) -> torch.Tensor | None:
    """arange(batch) of a linear-attention layer's states (None before any is written)."""
    for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
        for state in states.values():
            if state is not None:
                return torch.arange(state.shape[0], device=state.device)
    return None


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer writing keys/values in place into buffers with spare positions, instead of
    concatenating (copying) the whole cache every step. Buffers double when full, up to
    `max_length`, so a long `max_tokens` does not reserve memory it may never use."""

    def __init__(self, max_length: int) -> None:
        super().__init__()
        self.max_length = max_length
        self.length = 0
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers is None:
            self.lazy_initialization(key_states, value_states)
            self.buffers = (key_states[:, :, :0], value_states[:, :, :0])
        end = self.length + key_states.shape[-2]
        if end > self.buffers[0].shape[-2]:
            rows = torch.arange(key_states.shape[0], device=key_states.device)
            self._copy(rows, min(self.max_length, max(end + _CACHE_STEP, 2 * end)))
        buffers = self.buffers
        buffers[0][:, :, self.length : end] = key_states
        buffers[1][:, :, self.length : end] = value_states
        self.length = end
        return self._refresh(buffers)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.buffers is not None:
            rows = torch.arange(self.buffers[0].shape[0], device=self.buffers[0].device)
            self._copy(rows.repeat_interleave(repeats), self.buffers[0].shape[-2])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.buffers is not None:
            self._copy(indices, self.buffers[0].shape[-2])

    def _copy(self, rows: torch.Tensor, capacity: int) -> None:
        """New buffers of `capacity` positions holding the written positions of `rows`."""
        used = slice(0, self.length)
        new_buffers = []
        for old_BHTD in self.buffers or ():
            new_BHTD = old_BHTD.new_zeros(len(rows), old_BHTD.shape[1], capacity, old_BHTD.shape[3])
            new_BHTD[:, :, used] = old_BHTD[rows, :, used]
            new_buffers.append(new_BHTD)
        self.buffers = (new_buffers[0], new_buffers[1])
        self._refresh(self.buffers)

    def _refresh(
        self, buffers: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Point keys/values (what attention and get_seq_length read) at the written positions."""
        keys, values = (buffer[:, :, : self.length] for buffer in buffers)
        self.keys, self.values = keys, values
        return keys, values
