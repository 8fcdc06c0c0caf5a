"""PNG plots of one step's per-token tensors (advantages, ratios, logprobs): `plot_tensors`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from posttrain.trainer.datums import pad_masks
from posttrain.types import Datum, ForwardBackwardOutput


class TensorRecorder:
    """Collects the datums and learner logprobs of each mini-batch of a step."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {"advantages": [], "ratio": [], "logprobs": []}

    def record(self, datums: Sequence[Datum], output: ForwardBackwardOutput) -> None:
        for datum, out in zip(datums, output.loss_fn_outputs, strict=True):
            inputs = datum.loss_fn_inputs
            mask = inputs["mask"]  # every RL datum has one (trainer.datums.rl_datum)
            learner = out["logprobs"]
            self.rows["advantages"].append(inputs["advantages"] * mask)
            self.rows["ratio"].append(torch.exp(learner - inputs["logprobs"]) * mask)
            self.rows["logprobs"].append(learner * mask)

    def save(self, path: Path) -> Path:
        # A bare Agg Figure: no pyplot, so the caller's matplotlib backend is left alone.
        from matplotlib.figure import Figure

        fig = Figure(figsize=(15, 4))
        axes = fig.subplots(1, 3)
        for ax, (name, rows) in zip(axes, self.rows.items(), strict=True):
            image = pad_masks(rows).numpy() if rows else [[0.0]]
            shown = ax.imshow(image, aspect="auto", interpolation="nearest", cmap="coolwarm")
            ax.set_title(name)
            ax.set_xlabel("token")
            ax.set_ylabel("trajectory")
            fig.colorbar(shown, ax=ax)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        return path
