"""Where a worker's state lives: on its device, or parked on the CPU to make room.

A worker's state comes in three groups: the weights (with buffers, and the frozen reference copy
of full fine-tuning), the accumulated gradients, and the AdamW moments. `Dispatch` decides what
each operation needs on the device and what a phase may park (`KEEPS`, `NEEDS`); a worker's
`Parking` makes the moves and knows what is parked; the functions below move the tensors. On
CPU every move is a no-op that still runs (and is recorded by Dispatch), so the code path a GPU
takes is the one the tests exercise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

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


# Parking for sampling pays two copies of the gradients and moments over PCIe per RL step (at
# 0.5B full fine-tuning, 4 GB of fp32 moments each way) to free room the sampler's KV cache
# rarely needs on a large GPU. "auto" parks only where that state is a large share of the
# device: above this fraction of its total memory.
PARK_FOR_SAMPLING_SHARE = 0.25


def parks_for_sampling(model: nn.Module, device: torch.device) -> bool:
    """Whether sampling should park the gradients and AdamW moments ("auto"): always on the CPU,
    where a move is a no-op (so CPU runs take the GPU's code path), and on a GPU when they
    (3x the trainable weights' bytes: one gradient and two moments each) would fill more than
    PARK_FOR_SAMPLING_SHARE of its memory."""
    if device.type != "cuda":
        return True
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    total = torch.cuda.get_device_properties(device).total_memory
    return 3 * trainable > PARK_FOR_SAMPLING_SHARE * total


def move_module(module: nn.Module, device: torch.device) -> None:
    """Parameters (in place, so optimizer references stay valid), buffers and attached grads."""
    module.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """The per-parameter state tensors (AdamW's moments), and `step` where it lives beside them.

    The fused (and capturable) AdamW keeps each parameter's `step` on the parameter's device and
    refuses one elsewhere, so it moves with the moments; the foreach and loop implementations keep
    it on the CPU, where it stays. (Left behind, the fused steps held 512 bytes of GPU memory per
    parameter after an offload, measured on an H200.)
    """
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (key != "step" or step_on_device):
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


class StateHolder(Protocol):
    """What a worker lends its `Parking`: its tensors, wherever they are now."""

    @property
    def device(self) -> torch.device: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def weight_modules(self) -> list[nn.Module]: ...

    def trainable_parameters(self) -> dict[str, nn.Parameter]: ...


class Parking:
    """Which of one worker's state groups are parked on the CPU, and the moves there and back.

    The worker keeps its tensors; this decides what a move does. Parking a parked group, or
    reloading one on the device, does nothing: a move retried after it failed on another worker
    repeats safely (a second detach of the gradients would find none on the parameters and park
    None over the ones already parked). Gradients come back only onto weights on the device, and
    an operation on parked state is refused (`require`).
    """

    def __init__(self, holder: StateHolder) -> None:
        self._holder = holder
        self.offloaded: set[StateGroup] = set()
        self._grads: dict[str, torch.Tensor | None] = {}  # the parked gradients, by name

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Park `offload`, then bring `reload` back, in the order given."""
        for group in offload:
            self.offload(group)
        for group in reload:
            self.reload(group)

    def offload(self, group: StateGroup) -> None:
        """Park `group` on the CPU (a no-op move on a CPU worker, still tracked)."""
        if group in self.offloaded:
            return
        holder, cpu = self._holder, torch.device("cpu")
        if group == "weights":
            for module in holder.weight_modules():
                move_module(module, cpu)
        elif group == "grads":
            grads = detach_grads(holder.trainable_parameters())
            self._grads = {n: None if g is None else g.to(cpu) for n, g in grads.items()}
        else:
            move_optimizer_state(holder.optimizer, cpu)
        self.offloaded.add(group)
        free_device_cache(holder.device)

    def reload(self, group: StateGroup) -> None:
        """Bring a parked `group` back to the holder's device."""
        if group not in self.offloaded:
            return
        holder = self._holder
        if group == "weights":
            for module in holder.weight_modules():
                move_module(module, holder.device)
        elif group == "grads":
            self.require("weights")  # gradients go where their parameters are
            if self._grads:
                attach_grads(holder.trainable_parameters(), self._grads)
            self._grads = {}
        else:
            move_optimizer_state(holder.optimizer, holder.device)
        self.offloaded.discard(group)

    def require(self, *groups: StateGroup) -> None:
        """Refuse to run on parked state: Dispatch reloads what an operation needs first."""
        parked = [g for g in groups if g in self.offloaded]
        if parked:
            raise RuntimeError(
                f"{parked} are offloaded to the CPU; reload them first (Dispatch does so)"
            )

    def drop_grads(self) -> None:
        """The accumulated gradients were zeroed: parked ones too, so a reload attaches none."""
        self._grads = dict.fromkeys(self._grads)
