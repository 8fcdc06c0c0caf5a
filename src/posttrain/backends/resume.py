"""Directory checkpoints (LocalBackend, RayBackend): `checkpoints/<step>/` under the model's
directory, each a complete checkpoint with its trainer state, the newest few kept.

A step directory under `checkpoints/` that is not a complete checkpoint is damaged (a deleted
adapter file, a truncated weights file, no manifest). Resuming past it, at an older step or
from the base weights, would silently drop the steps it held, so it is an error that names it
and offers `resume_step`. Debris of an interrupted write is not a step directory, and is handled
quietly: hidden `.N.tmp-*` directories are deleted, and a `.N.old-*` copy is put back where N
went missing (`engine.checkpoint.step_directories`).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from posttrain.backends.checkpoint_index import Checkpoint, ResumePoint
from posttrain.backends.model import TrainableModel
from posttrain.backends.model_json import model_record
from posttrain.clients.protocol import SavesTrainerState
from posttrain.engine.checkpoint import (
    checkpoint_problem,
    is_complete_checkpoint,
    prune_checkpoints,
    remove_step_debris,
    step_directories,
)
from posttrain.trainer.steps import RunState


class DirectoryCheckpoints:
    """The `CheckpointIndex` of step directories; each save keeps the newest `keep` of them."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.keep = keep

    def resume_point(
        self, model: TrainableModel, directory: Path, resume_step: int | None
    ) -> ResumePoint:
        """The latest step directory, which must be complete; or, with `resume_step`, that
        step's. Its trainer state is read here, before any model loads."""
        checkpoints = directory / "checkpoints"
        chosen, later = _choose(model, checkpoints, resume_step)
        checkpoint = None
        if chosen is not None:
            checkpoint = Checkpoint(str(chosen), *read_trainer_state(chosen))
        return ResumePoint(checkpoint, lambda: set_aside(later, checkpoints, resume_step))

    def checkpoint_of(self, directory: Path, step: int) -> str | None:
        path = directory / "checkpoints" / str(step)
        return str(path) if is_complete_checkpoint(path) else None

    async def save(self, client: SavesTrainerState, model: TrainableModel, step: int) -> str:
        """`checkpoints/<step>` with the trainer state inside, written atomically; then prune."""
        record = model_record(model.directory, model)
        state = {"step": step, "run_state": model.run_state, "model": record}
        saved = await client.save_state(str(step), trainer_state=state)
        try:
            prune_checkpoints(model.directory / "checkpoints", self.keep)
        except Exception:
            if step > model.step:  # the step is not done after all: nor is its checkpoint
                shutil.rmtree(saved.path, ignore_errors=True)
            raise
        return saved.path


def _choose(
    model: TrainableModel, checkpoints: Path, resume_step: int | None
) -> tuple[Path | None, list[Path]]:
    """The step directory to resume (None: the base model) and those after it to set aside.

    Hidden debris of an interrupted write (`.N.tmp-*`, `.N.old-*`) is no step: it is cleaned
    up, or put back (see `step_directories`).
    """
    steps = step_directories(checkpoints)
    remove_step_debris(checkpoints)  # registering makes this process the one writer here
    if resume_step is None:
        if not steps:
            return None, []
        latest = steps[-1]
        problem = checkpoint_problem(latest)
        if problem is not None:
            complete = [int(p.name) for p in steps[:-1] if is_complete_checkpoint(p)]
            fallback = complete[-1] if complete else None
            raise DamagedCheckpointError(
                damaged_message(model, str(latest), problem, fallback, f"delete {latest}")
            )
        return latest, []
    chosen = checkpoints / str(resume_step)
    later = [p for p in steps if int(p.name) > resume_step]
    if resume_step == 0 and not any(p.name == "0" for p in steps):
        return None, later  # step 0 is the base model
    problem = checkpoint_problem(chosen)
    if problem is not None:
        complete = [p.name for p in steps if is_complete_checkpoint(p)]
        raise ValueError(resume_step_message(model, resume_step, problem, checkpoints, complete))
    return chosen, later


def read_trainer_state(checkpoint: Path) -> tuple[int, RunState]:
    """(step, run_state) saved with a checkpoint by `DirectoryCheckpoints.save`."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    missing = [key for key in ("step", "run_state") if key not in state]
    if missing:
        raise ValueError(
            f"{checkpoint}/trainer_state.json has no {' or '.join(missing)}: it was not written "
            "by a posttrain backend; move the checkpoint away or register under another name"
        )
    return int(state["step"]), dict(state["run_state"])


class DamagedCheckpointError(ValueError):
    """The latest checkpoint of a model is not intact, so resuming it is refused."""


def damaged_message(
    model: TrainableModel, latest: str, problem: str, fallback: int | None, remove: str
) -> str:
    """The error for a damaged latest checkpoint: what it is, and the two ways out (resume the
    newest intact step `fallback`, None: the base model; or repair it, `remove`)."""
    if fallback is not None:
        step, option = fallback, f"resume from step {fallback}, its newest complete checkpoint"
    else:
        step, option = 0, "start again from the base model (it has no other complete checkpoint)"
    return (
        f"cannot resume model {model.name!r}: its latest checkpoint {latest} is damaged "
        f"({problem}). To {option}, register with resume_step={step} (posttrain train: "
        f"--resume-step {step}); the checkpoints after step {step} are then moved aside, not "
        f"deleted. Or restore {latest} from a copy, or {remove} yourself"
    )


def resume_step_message(
    model: TrainableModel, resume_step: int, problem: str, where: Path, complete: Sequence[object]
) -> str:
    return (
        f"cannot resume model {model.name!r} from a chosen step, resume_step={resume_step}: "
        f"{problem}. Complete checkpoints in {where}: {complete or 'none'}; resume_step=0 "
        "starts from the base model"
    )


def set_aside(later: list[Path], checkpoints: Path, resume_step: int | None) -> None:
    """Move the step directories after an explicit `resume_step` into a directory of their own
    (kept, never deleted), so the steps trained from there on do not collide with them."""
    if not later:
        return
    aside = checkpoints / f"set-aside-after-step-{resume_step}-{stamp()}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)


def stamp() -> str:
    """Time and a random suffix: names a set-aside that never collides with an earlier one."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
