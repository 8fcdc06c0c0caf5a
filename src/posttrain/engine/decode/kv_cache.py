"""KV caches: a sampling cache that writes in place into growing buffers, and the keyword by
which a model's forward takes one.

transformers' DynamicCache concatenates (copies) the whole cache at every decoding step; this
layer writes each step's keys and values into spare positions instead.
"""

from __future__ import annotations

import functools
import inspect
from typing import Literal

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

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
