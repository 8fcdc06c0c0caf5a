"""Custom losses on the logprobs (Tinker's `forward_backward_custom`), and the named-loss registry.

A custom loss is `loss_fn(data, logprobs) -> (loss, metrics)`: `logprobs[i]` holds datum i's
target logprobs (shape of its `target_tokens`) as a leaf tensor, and `loss` is a 0-d tensor.
As the tinker SDK runs it: a forward pass gives the logprobs, the loss runs on them, and its
gradient g_t = ∂C/∂lp_t becomes the weights w_t = −g_t of a cross_entropy backward. Since
cross_entropy is L = −Σ w_t·lp_t, ∇_θ L = Σ g_t·∇_θ lp_t = ∇_θ C exactly.

Unlike the SDK, a loss that is not a finite 0-d tensor, or whose gradient is not finite, is
refused before the backward pass, so nothing is accumulated.

Named losses: `register_loss(name, fn)`, or an entry point in the group `posttrain.losses`
(`my_loss = "mypkg.losses:my_loss"`), make `train(loss=LossName("my_loss"))` run `fn` through
`forward_backward_custom` on every backend; so does a dotted path, `loss="mypkg.losses:my_loss"`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType, cast

import torch

from posttrain.algo.loss_metrics import counted_values, summarize_values
from posttrain.algo.losses import LOSSES, LossConfig, get_loss
from posttrain.clients.token_metrics import run_builtin
from posttrain.finder import DOTTED_PATH, Kind, entry_points, load
from posttrain.types import Datum, ForwardBackwardOutput

CustomLossFn = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, Mapping[str, float]]]
# The name of a loss registered here or under the entry point group, for `train(loss=...)`.
LossName = NewType("LossName", str)
ENTRY_POINT_GROUP = "posttrain.losses"

_registered: dict[str, CustomLossFn] = {}
# Losses of preference pairs (DPO's): they read datums `train_dpo` builds, so `train(loss=)`
# neither offers nor takes them.
_pair_losses: set[str] = set()


def register_loss(name: str, fn: CustomLossFn, *, pairs: bool = False) -> LossName:
    """Make `fn` the loss named `name` (a built-in loss's name is refused); `pairs=True`: a
    loss of preference pairs, not a policy loss."""
    if name in LOSSES:
        raise ValueError(f"loss name {name!r} is a built-in loss of posttrain.algo.losses")
    _registered[name] = fn
    (_pair_losses.add if pairs else _pair_losses.discard)(name)
    return LossName(name)


@functools.cache  # option checks ask often; a test that installs one clears it
def _entry_points() -> dict[str, str]:
    return entry_points(ENTRY_POINT_GROUP)


def custom_loss_names() -> list[str]:
    return sorted({*_registered, *_entry_points()})


def is_custom_loss(name: object) -> bool:
    """Registered, an entry point, or a dotted path ("pkg.module:function", imported on first
    use, as rewards and tasks are)."""
    return isinstance(name, str) and (
        name in _registered or name in _entry_points() or DOTTED_PATH.match(name) is not None
    )


def is_pair_loss(name: object) -> bool:
    """A registered loss of preference pairs (`train_dpo`'s), not a policy loss."""
    return name in _pair_losses


def policy_loss_names() -> list[str]:
    """The custom losses `train(loss=)` takes: all but the pair losses."""
    return [name for name in custom_loss_names() if name not in _pair_losses]


def custom_loss(name: str, *, search: Path | None = None) -> CustomLossFn:
    """The loss registered as `name`, loading its entry point or importing its dotted path
    the first time (`search`: a directory to import from after `sys.path`, a job's config
    directory)."""
    if name not in _registered:  # a Kind of this call's table: tests swap `_registered`
        losses = Kind(
            "custom loss",
            _registered,
            ENTRY_POINT_GROUP,
            example="mypkg.losses:my_loss",
            plural="custom losses",
            also="register it with register_loss",
        )
        loaded = load(name, losses, search=search)
        if not callable(loaded):
            raise TypeError(f"loss {name!r} is not a function: {type(loaded).__name__}")
        _registered[name] = cast(CustomLossFn, loaded)  # its result is checked at each call
    return _registered[name]


def builtin_as_custom(name: str, config: LossConfig) -> CustomLossFn:
    """Loss `name` of `algo.losses` as a custom loss: the same value and logprob gradient, so
    posttrain's own loss code runs where only logprobs come back (a remote service)."""
    get_loss(name)  # an unknown name fails here, not at the first step

    def loss(
        data: list[Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out, mask_BT = run_builtin(name, config, data, logprobs)
        return out.loss, summarize_values(counted_values(out, mask_BT))

    return loss


@dataclass(frozen=True)
class CustomGradients:
    """The backward pass's datums (weights −∂C/∂lp), the loss's metrics and its value."""

    data: list[Datum]
    metrics: dict[str, float]
    loss_sum: float


def forward_data(data: Sequence[Datum]) -> list[Datum]:
    """The forward pass's datums: target_tokens, and weights (zeros when the datum has none)."""
    out: list[Datum] = []
    for i, datum in enumerate(data):
        if "target_tokens" not in datum.loss_fn_inputs:
            raise ValueError(f"forward_backward_custom: datum {i} has no target_tokens")
        targets = datum.loss_fn_inputs["target_tokens"]
        weights = datum.loss_fn_inputs.get("weights", torch.zeros(targets.shape))
        out.append(Datum(datum.model_input, {"target_tokens": targets, "weights": weights}))
    return out


def custom_gradients(
    data: Sequence[Datum], loss_fn: CustomLossFn, logprobs: Sequence[torch.Tensor]
) -> CustomGradients:
    """Run `loss_fn` on leaf copies of `logprobs`; refuse a loss or gradient that is not
    finite, or a loss that is not 0-d (ValueError naming what was wrong)."""
    leaves = [lp.detach().to(torch.float32).clone().requires_grad_(True) for lp in logprobs]
    result = loss_fn(list(data), leaves)
    if not isinstance(result, tuple) or len(result) != 2:
        raise ValueError("a custom loss must return (loss, metrics), a 0-d tensor and a dict")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"a custom loss must return a scalar (0-d) tensor, got {shape}: reduce it with "
            ".sum() or .mean() (nothing was accumulated)"
        )
    if not bool(torch.isfinite(loss)):
        raise ValueError(f"the custom loss is {loss.item()} (nothing was accumulated)")
    if not loss.requires_grad:
        raise ValueError("the custom loss does not depend on the logprobs it was given")
    loss.backward()
    grads = [lp.grad if lp.grad is not None else torch.zeros_like(lp) for lp in leaves]
    for i, grad in enumerate(grads):
        if not bool(torch.isfinite(grad).all()):
            raise ValueError(
                f"the custom loss's gradient is not finite on datum {i} (nothing was accumulated)"
            )
    backward = [
        Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": -g})
        for d, g in zip(data, grads, strict=True)
    ]
    return CustomGradients(
        backward, {k: float(v) for k, v in metrics.items()}, float(loss.detach())
    )


def custom_output(
    backward: ForwardBackwardOutput, custom: CustomGradients
) -> ForwardBackwardOutput:
    """The backward pass's output with the SDK's metrics: `loss:sum` the custom loss's value,
    `surrogate_loss:sum` the cross_entropy surrogate's, and the loss's own metrics."""
    metrics = dict(backward.metrics)
    surrogate = metrics.pop("loss:sum")
    metrics.update(custom.metrics)
    metrics["loss:sum"] = custom.loss_sum
    metrics["surrogate_loss:sum"] = surrogate
    return ForwardBackwardOutput(backward.loss_fn_output_type, backward.loss_fn_outputs, metrics)
