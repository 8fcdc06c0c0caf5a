"""Gradient checkpointing that keeps the KV cache: decoder layers recomputed in backward.

Only each decoder layer's input is kept for backward; the layer runs again when its gradient
is needed, trading about one more forward pass for activations of a single layer at a time.

transformers' own gradient checkpointing cannot serve here: it drops the cache of any layer
that writes one (`cache=None`), and the shared-prefix pass (`engine.shared_prefix`) runs each
member's tokens on its prefix's cache, so those tokens would silently lose their prefix. Here
a layer's cache entry is put back as it was before the layer ran whenever the layer is
recomputed, so the replay computes exactly what the forward did.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer


def enable_gradient_checkpointing(model: nn.Module) -> int:
    """Recompute every decoder layer of `model` in backward; returns how many layers.

    Applies in training mode with gradients enabled only: sampling and no-grad passes run the
    layers as they are. Deep copies of the model keep the setting.
    """
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no transformers decoder layers to checkpoint")
    for position, layer in enumerate(layers):
        index = _cache_index(layer, position)
        # An instance attribute, bound to the layer, so that copy.deepcopy rebinds it.
        layer.forward = types.MethodType(functools.partial(_checkpointed, index), layer)
    return len(layers)


def _cache_index(layer: nn.Module, position: int) -> int:
    """The layer's index in the KV cache: its attention's `layer_idx`, else its position."""
    for module in layer.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return position


def _checkpointed(
    index: int, layer: nn.Module, hidden: torch.Tensor, *args: object, **kwargs: object
) -> torch.Tensor:
    forward: Callable[..., torch.Tensor] = functools.partial(type(layer).forward, layer)
    if not (layer.training and torch.is_grad_enabled()):
        return forward(hidden, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    saved = dict(vars(layers[index])) if layers is not None and index < len(layers) else None

    def replay(hidden: torch.Tensor) -> torch.Tensor:
        if layers is not None:
            if saved is None:  # the forward created this entry: drop it before running again
                del layers[index:]
            else:
                entry = layers[index]
                entry.__dict__.clear()
                entry.__dict__.update(saved)
        return forward(hidden, *args, **kwargs)

    out = checkpoint(replay, hidden, use_reentrant=False)
    return out
