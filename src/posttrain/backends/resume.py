"""Which checkpoint a registration resumes: the latest, complete, or an explicitly chosen one.

A step directory under `checkpoints/` that is not a complete checkpoint is damaged (a deleted
adapter file, a truncated weights file, no manifest). Resuming past it, at an older step or
from the base weights, would silently drop the steps it held, so it is an error that names it
and offers `resume_step`. Debris of an interrupted write is not a step directory, and is handled
quietly: hidden `.N.tmp-*` directories are deleted, and a `.N.old-*` copy is put back where N
went missing (`engine.checkpoint.step_directories`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from posttrain.engine.checkpoint import (
    checkpoint_problem,
    is_complete_checkpoint,
    remove_step_debris,
    step_directories,
)
from posttrain.model import TrainableModel


@dataclass(frozen=True)
class ResumePoint:
    """Where a registration starts: a checkpoint (None: the base model), and the step
    directories after it, which an explicit `resume_step` sets aside."""

    checkpoint: Path | None
    later: list[Path]


def resume_point(model: TrainableModel, checkpoints: Path, resume_step: int | None) -> ResumePoint:
    """The latest checkpoint, which must be complete; or, with `resume_step`, that step's.

    Hidden debris of an interrupted write (`.N.tmp-*`, `.N.old-*`) is no step: it is cleaned
    up, or put back (see `step_directories`). A step directory that is not a complete checkpoint
    is damaged, and resuming past it silently would lose its steps: an error gives the choice.
    """
    steps = step_directories(checkpoints)
    remove_step_debris(checkpoints)  # registering makes this process the one writer here
    if resume_step is None:
        if not steps:
            return ResumePoint(None, [])
        latest = steps[-1]
        problem = checkpoint_problem(latest)
        if problem is not None:
            raise DamagedCheckpointError(damaged_message(model, latest, problem, steps[:-1]))
        return ResumePoint(latest, [])
    chosen = checkpoints / str(resume_step)
    later = [p for p in steps if int(p.name) > resume_step]
    if resume_step == 0 and not any(p.name == "0" for p in steps):
        return ResumePoint(None, later)  # step 0 is the base model
    problem = checkpoint_problem(chosen)
    if problem is not None:
        complete = [p.name for p in steps if is_complete_checkpoint(p)]
        raise ValueError(
            f"cannot resume model {model.name!r} from step {resume_step} (resume_step): "
            f"{problem}. Complete checkpoints in {checkpoints}: {complete or 'none'}; "
            "resume_step=0 starts from the base model"
        )
    return ResumePoint(chosen, later)


class DamagedCheckpointError(ValueError):
    """The latest checkpoint of a model is not complete, so resuming it is refused."""


def damaged_message(model: TrainableModel, latest: Path, problem: str, earlier: list[Path]) -> str:
    complete = [p for p in earlier if is_complete_checkpoint(p)]
    if complete:
        step = complete[-1].name
        option = f"resume from step {step}, its newest complete checkpoint"
    else:
        step = "0"
        option = "start again from the base model (it has no other complete checkpoint)"
    return (
        f"cannot resume model {model.name!r}: its latest checkpoint {latest} is damaged "
        f"({problem}). To {option}, register with resume_step={step} (posttrain train: "
        f"--resume-step {step}); the checkpoints after step {step} are then moved aside, not "
        f"deleted. Or restore {latest} from a copy, or delete it yourself"
    )


def set_aside(later: list[Path], checkpoints: Path, resume_step: int | None) -> None:
    """Move the step directories after an explicit `resume_step` into a directory of their own
    (kept, never deleted), so the steps trained from there on do not collide with them."""
    if not later:
        return
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    aside = checkpoints / f"set-aside-after-step-{resume_step}-{stamp}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
