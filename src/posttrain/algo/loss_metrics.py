"""Step metrics from the losses' per-token diagnostics, keyed in Tinker's `name:reduction` form.

Every statistic is over the counted tokens of all the micro-batches given, taken as one
multiset: values are sorted before they are summed, so any split of the same batch into
micro-batches, in any order, gives bit-identical metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from posttrain.algo.losses import LossOutput

# The 0/1 "clipped" diagnostic averages to a fraction; other keys keep their names.
_METRIC_NAMES = {"clipped": "clipped_frac"}
_PERCENTILES = {"ratio": (95,)}


def summarize(
    outputs: Sequence[LossOutput], masks_BT: Sequence[torch.Tensor] | None = None
) -> dict[str, float]:
    """`loss:sum`, token means `<key>:mean` of every diagnostic and `ratio:p95`, over the tokens
    of `masks_BT` (default: each output's own `mask_BT`).
    """
    if masks_BT is None:
        masks_BT = [_own_mask(i, output) for i, output in enumerate(outputs)]
    if len(masks_BT) != len(outputs):
        raise ValueError(f"got {len(masks_BT)} masks for {len(outputs)} outputs; pass one each")
    values: dict[str, list[torch.Tensor]] = {}
    for output, mask_BT in zip(outputs, masks_BT, strict=True):
        for key, flat in counted_values(output, mask_BT).items():
            values.setdefault(key, []).append(flat)
    metrics = {"loss:sum": math.fsum(float(output.loss.detach()) for output in outputs)}
    metrics.update(summarize_values({k: torch.cat(v) for k, v in values.items()}))
    return metrics


def counted_values(
    output: LossOutput, mask_BT: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Each diagnostic's values on the counted tokens, flattened to 1-D (float64, CPU).

    Flat values from several micro-batches or ranks concatenate into the whole batch's.
    """
    counted_BT = (output.mask_BT if mask_BT is None else mask_BT) != 0
    return {
        key: value_BT.detach()[counted_BT].double().cpu()
        for key, value_BT in output.per_token.items()
    }


def summarize_values(values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """`<key>:mean` of each diagnostic's flat values and ratio percentiles (`ratio_p95:max`)."""
    metrics: dict[str, float] = {}
    for key, flat in sorted(values.items()):
        sorted_values = flat.double().sort().values
        if sorted_values.numel() == 0:
            continue
        name = _METRIC_NAMES.get(key, key)
        metrics[f"{name}:mean"] = float(sorted_values.sum()) / sorted_values.numel()
        for percent in _PERCENTILES.get(key, ()):
            # ":max" so the tinker SDK, which merges metrics by reduction, keeps it.
            metrics[f"{name}_p{percent}:max"] = _sorted_quantile(sorted_values, percent / 100)
    return metrics


def _own_mask(index: int, output: LossOutput) -> torch.Tensor:
    if output.mask_BT is None:
        raise ValueError(f"outputs[{index}] has no mask_BT; pass masks_BT to summarize")
    return output.mask_BT


def _sorted_quantile(sorted_values: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile of ascending values (numpy's default method)."""
    position = q * (sorted_values.numel() - 1)
    below = math.floor(position)
    above = min(below + 1, sorted_values.numel() - 1)
    low, high = float(sorted_values[below]), float(sorted_values[above])
    return low + (high - low) * (position - below)
