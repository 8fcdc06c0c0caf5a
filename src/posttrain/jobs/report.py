"""What the job writes besides checkpoints: metrics JSONL rows, progress lines, the curve PNG."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.jobs.pipeline import TIMING_METRICS
from posttrain.trainer.progress import duration

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Keys whose values depend on the machine, not on the run (left out when comparing runs).
TIMING_KEYS = (
    frozenset({"elapsed_s", "step_s", "tokens_per_s", "sample_tokens_per_s"}) | TIMING_METRICS
)


class MetricsLog:
    """Append-only `metrics.jsonl`; rows are `{"phase": ..., "step": ..., metrics...}`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self) -> list[dict[str, object]]:
        return read_jsonl(self.path)

    def rewind(self, rl_steps_done: int, *, sft_done: bool, dpo_done: bool = False) -> None:
        """Keep the rows the resumed checkpoint covers; the job redoes the rest.

        The job writes a step's row before checkpointing the step, and evaluates after: so the
        checkpoint after `rl_steps_done` RL steps covers the SFT and DPO rows (if they are done),
        RL rows up to that step and evaluations before it.
        """
        kept = [
            row
            for row in self.rows()
            if (row["phase"] == "sft" and sft_done)
            or (row["phase"] == "dpo" and dpo_done)
            or (row["phase"] == "rl" and _step(row) <= rl_steps_done)
            or (row["phase"] == "eval" and _step(row) < rl_steps_done)
        ]
        write_jsonl(self.path, kept)

    def write(self, phase: str, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, object] = {"phase": phase, "step": step}
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def rewind_history(path: Path, model_step: int) -> None:
    """Keep the `model.log` rows of `history.jsonl` that a checkpoint at `model_step` covers.

    The job logs a training step before checkpointing it, and evaluations (split "val") after
    the checkpoint of the step they evaluate.
    """
    kept = [
        row
        for row in read_jsonl(path)
        if _step(row) < model_step or (_step(row) == model_step and row["split"] == "train")
    ]
    write_jsonl(path, kept)


def read_jsonl(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    if path.exists() or rows:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _step(row: Mapping[str, object]) -> int:
    step = row["step"]
    return step if isinstance(step, int) else 0


def progress_line(
    step: int, steps: int, metrics: Mapping[str, float], *, eta_s: float | None = None
) -> str:
    """One line per RL step: step, reward, accuracy, loss, throughput, where the row has them
    the seconds the trainer waited for rollouts and synced the engine and the tokens' mean
    staleness, elapsed, and the time left (`eta_s`, when given).

    `tok/s` is the whole step's: sampled tokens over the step's wall time (sampling, training
    and logging; the checkpoint save after them is not counted), not the sampler's speed alone,
    which is `sample_tokens_per_s` in metrics.jsonl.
    """
    # No loss when every group had zero reward variance (nothing to train on this step).
    loss = f"{metrics['loss']:+.4f}" if math.isfinite(metrics["loss"]) else "    n/a"
    eta = f"  eta {duration(eta_s)}" if eta_s is not None else ""
    pipeline = ""
    if "time/wait_for_rollouts_s" in metrics:
        pipeline = (
            f"  wait {metrics['time/wait_for_rollouts_s']:.2f}s  "
            f"sync {metrics['time/sync_s']:.2f}s  stale {metrics['staleness/mean']:.2f}"
        )
    return (
        f"rl step {step:>4}/{steps}  reward {metrics['reward']:.3f}  "
        f"acc {metrics['accuracy']:.3f}  loss {loss}  "
        f"tok/s {metrics['tokens_per_s']:>7,.0f}{pipeline}  "
        f"elapsed {metrics['elapsed_s']:6.1f}s{eta}"
    )


def _series(rows: list[dict[str, object]], key: str) -> list[float]:
    values = [row.get(key) for row in rows]  # absent is real: eval rows have no reward
    return [float(v) if isinstance(v, int | float) else math.nan for v in values]


def plot_curves(rows: list[dict[str, object]], path: Path, title: str) -> Path:
    """Train reward and accuracy per RL step, with held-out accuracy as markers."""
    # A bare Agg Figure: no pyplot, so the caller's matplotlib backend is left alone.
    from matplotlib.figure import Figure

    train = [r for r in rows if r["phase"] == "rl"]
    held = [r for r in rows if r["phase"] == "eval"]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    steps = _series(train, "step")
    ax.plot(steps, _series(train, "reward"), label="train reward (mean)", lw=1.2)
    ax.plot(steps, _series(train, "accuracy"), label="train accuracy (sampled)", lw=1.2, alpha=0.7)
    ax.plot(
        _series(held, "step"),
        _series(held, "accuracy"),
        "o-",
        color="black",
        label="held-out accuracy (greedy)",
    )
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Write `fig` as a PNG at `path` atomically: a reader sees the old plot or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
