"""Where a worker's state lives: on its device, or parked on the CPU to make room.

A worker's state comes in three groups: the weights (with buffers, and the frozen reference copy
of full fine-tuning), the accumulated gradients, and the AdamW moments. `Dispatch` decides what
each operation needs on the device and what a phase may park (`KEEPS`, `NEEDS`); the functions
here do the moving. On CPU every move is a no-op that still runs (and is recorded by Dispatch),
so the code path a GPU takes is the one the tests exercise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

StateGroup = Literal["weights", "grads", "optimizer"]
# Reload order; offloading runs in reverse (gradients leave before the weights they belong to).
GROUPS: tuple[StateGroup, ...] = ("weights", "grads", "optimizer")

Placement = Literal["train", "sample", "offloaded"]
# What may stay on the device in each placement. Sampling keeps only the weights, so the KV
# cache gets the room the gradients and the AdamW moments (2x the trainable weights) took;
# "offloaded" parks everything, for a process that hands the device to another engine.
KEEPS: dict[Placement, frozenset[StateGroup]] = {
    "train": frozenset(GROUPS),
    "sample": frozenset({"weights"}),
    "offloaded": frozenset(),
}

Operation = Literal[
    "forward", "forward_backward", "optim_step", "sample", "reference", "save", "load", "offload"
]
# What each operation reads or writes on the device. Training reloads lazily: a
# forward_backward after sampling brings back the gradients, and only optim_step the moments.
# Saving reads tensors wherever they are; loading writes optimizer state to the parameters'
# device, so it needs the optimizer where it is tracked to be.
NEEDS: dict[Operation, frozenset[StateGroup]] = {
    "forward": frozenset({"weights"}),
    "forward_backward": frozenset({"weights", "grads"}),
    "optim_step": frozenset(GROUPS),
    "sample": frozenset({"weights"}),
    "reference": frozenset({"weights"}),
    "save": frozenset(),
    "load": frozenset({"weights", "optimizer"}),
    "offload": frozenset(),
}


def move_module(module: nn.Module, device: torch.device) -> None:
    """Parameters (in place, so optimizer references stay valid), buffers and attached grads."""
    module.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The per-parameter state tensors (AdamW's moments); `step` stays where AdamW keeps it."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)


def detach_grads(params: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor | None]:
    """Take the parameters' gradients off them (each `.grad` becomes None) and return them."""
    taken = {name: p.grad for name, p in params.items()}
    for p in params.values():
        p.grad = None
    return taken


def attach_grads(
    params: Mapping[str, nn.Parameter], grads: Mapping[str, torch.Tensor | None]
) -> None:
    """Put `grads` back on their parameters' device, replacing whatever `.grad` holds."""
    for name, p in params.items():
        grad = grads[name]
        p.grad = None if grad is None else grad.to(p.device)


def add_grads(
    params: Mapping[str, nn.Parameter], earlier: Mapping[str, torch.Tensor | None]
) -> None:
    """`.grad += earlier` per parameter, in place (None counts as zero)."""
    for name, p in params.items():
        grad = earlier[name]
        if grad is None:
            continue
        if p.grad is None:
            p.grad = grad.to(p.device)
        else:
            p.grad.add_(grad.to(p.device))


def free_device_cache(device: torch.device) -> None:
    """Return freed blocks to the driver, so another process (a sampler engine) can use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
