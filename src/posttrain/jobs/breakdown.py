"""Where a run's RL steps spent their time: per-phase totals from `history.jsonl`, a table and a
plot of them (`posttrain report`).

Each RL step's row has `time/step_s`, the trainer's wall time for the step from asking for its
rollouts to the end of `backend.train`, split into the phases `PHASES`: waiting for rollouts,
training, the engine's weight sync, and what runs between them (`other`: dropping stale
trajectories, counting tokens). Sampling is shown beside them, not among them: with
`max_off_policy_steps > 0` it runs while earlier steps train, so only the wait adds to a step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from posttrain.jobs.report import save_figure

HISTORY = "history.jsonl"
PLOT = "time_breakdown.png"  # beside the job's curve.png
# The parts of `time/step_s`, in the order they are stacked; `other` is the rest.
PHASES = ("wait_for_rollouts", "train", "sync", "other")
STEP_KEY = "time/step_s"


@dataclass(frozen=True)
class Breakdown:
    """A run's RL steps' times (seconds per step, in step order) and their summaries."""

    steps: list[int]  # model steps
    phases: dict[str, list[float]]  # PHASES, plus "sample" and "step"
    staleness_max: float  # over the run
    staleness_mean: float  # token-weighted over the run's trained tokens
    sampled_tokens_per_s: float  # all sampled tokens / all sampling seconds
    trained_tokens_per_s: float  # all trained tokens / all training seconds
    sync_bytes: float  # in total
    sync_version: float | None  # the engine's after the last step; None: no sync reported

    def total(self, phase: str) -> float:
        return math.fsum(self.phases[phase])

    def share(self, phase: str) -> float:
        """The phase's part of the steps' wall time."""
        step = self.total("step")
        return self.total(phase) / step if step > 0 else 0.0


def find_history(run_dir: Path) -> Path:
    """The history.jsonl of a run directory (`<output_dir>/<project>/models/<name>/`, as the
    job prints it) or of the one model directory under `run_dir/models/`."""
    if (run_dir / HISTORY).is_file():
        return run_dir / HISTORY
    found = sorted((run_dir / "models").glob(f"*/{HISTORY}"))
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(p.parent.name for p in found)
        raise ValueError(f"{run_dir} holds several runs ({names}): pass one of models/<name>/")
    raise FileNotFoundError(
        f"{run_dir} is not a run directory: expected <output_dir>/<project>/models/<name>/ "
        f"holding {HISTORY}, as `posttrain train` prints it (run directory: ...)"
    )


def read_breakdown(history: Path) -> Breakdown:
    """The time breakdown of the RL steps logged in `history`."""
    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    rl = [r for r in rows if r.get("split") == "train" and isinstance(r.get(STEP_KEY), float)]
    if not rl:
        raise ValueError(
            f"{history} has no RL step with {STEP_KEY}: the run trained no RL step yet, or "
            "was trained by a posttrain that did not record step times"
        )

    def series(key: str) -> list[float]:
        return [float(r.get(key) or 0.0) for r in rl]

    phases = {
        name: series(f"time/{name}_s") for name in ("sample", "wait_for_rollouts", "train", "sync")
    }
    phases["step"] = series(STEP_KEY)
    timed = zip(*(phases[p] for p in ("step", "wait_for_rollouts", "train", "sync")), strict=True)
    phases["other"] = [max(step - wait - train - sync, 0.0) for step, wait, train, sync in timed]
    trained = series("tokens/trained")
    versions = [r["sync/version"] for r in rl if isinstance(r.get("sync/version"), float)]
    return Breakdown(
        steps=[int(r["step"]) for r in rl],
        phases=phases,
        staleness_max=max(series("staleness/max")),
        staleness_mean=_ratio(
            math.fsum(s * n for s, n in zip(series("staleness/mean"), trained, strict=True)),
            math.fsum(trained),
        ),
        sampled_tokens_per_s=_ratio(
            math.fsum(series("tokens/sampled")), math.fsum(phases["sample"])
        ),
        trained_tokens_per_s=_ratio(math.fsum(trained), math.fsum(phases["train"])),
        sync_bytes=math.fsum(series("sync/bytes")),
        sync_version=versions[-1] if versions else None,
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def table(breakdown: Breakdown) -> str:
    """The per-phase table and the staleness, throughput and sync summaries."""
    n = len(breakdown.steps)
    lines = [
        f"time breakdown over {n} RL steps (model steps {breakdown.steps[0]}-"
        f"{breakdown.steps[-1]})",
        f"{'phase':<20} {'total s':>10} {'mean s/step':>12} {'share':>7}",
    ]
    sample_note = "sample (beside)"
    for phase in (*PHASES, "step", sample_note):
        key = "sample" if phase == sample_note else phase
        total = breakdown.total(key)
        lines.append(f"{phase:<20} {total:>10.3f} {total / n:>12.3f} {breakdown.share(key):>7.1%}")
    version = "none" if breakdown.sync_version is None else f"{breakdown.sync_version:.0f}"
    lines += [
        "step: the trainer's wall time, wait_for_rollouts + train + sync + other",
        "sample: the rollouts' sampling, beside training when max_off_policy_steps > 0",
        f"staleness: max {breakdown.staleness_max:.0f}, mean {breakdown.staleness_mean:.2f} "
        "(model steps, token-weighted)",
        f"throughput: {breakdown.sampled_tokens_per_s:,.0f} sampled tokens/s (over sampling "
        f"time), {breakdown.trained_tokens_per_s:,.0f} trained tokens/s (over training time)",
        f"sync: {breakdown.sync_bytes:,.0f} bytes in all, engine at version {version}",
    ]
    return "\n".join(lines)


def plot_breakdown(breakdown: Breakdown, path: Path, title: str) -> Path:
    """Each RL step's phases as stacked bars, its sampling time as a line (atomic write)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    bottom = [0.0] * len(breakdown.steps)
    for phase in PHASES:
        values = breakdown.phases[phase]
        ax.bar(breakdown.steps, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.plot(breakdown.steps, breakdown.phases["sample"], "k.-", label="sample (beside)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("model step")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return save_figure(fig, path)
