"""Tinker's checkpoint index (TinkerBackend): `checkpoints.jsonl` in the model directory, a line
per checkpoint saved on the service with its `tinker://` path, step and trainer state.

Lines are appended and fsynced one at a time, so a crash can cut only the last one short: that
unterminated tail is debris, dropped (or, if whole, terminated) when the index is next read. A
last line that is not a record is damage, as a damaged latest step directory is: resuming past
it would silently drop what it recorded, so it is an error that names the way out.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.backends.checkpoint_index import Checkpoint, ResumePoint
from posttrain.backends.model import TrainableModel
from posttrain.backends.model_json import model_record
from posttrain.backends.resume import (
    DamagedCheckpointError,
    damaged_message,
    resume_step_message,
    stamp,
)

if TYPE_CHECKING:
    from posttrain.clients.tinker import TinkerTrainingClient

INDEX = "checkpoints.jsonl"


class JsonlCheckpoints:
    """The `CheckpointIndex` of `tinker://` checkpoints recorded in `checkpoints.jsonl`."""

    def resume_point(
        self, model: TrainableModel, directory: Path, resume_step: int | None
    ) -> ResumePoint:
        """The last record of the highest step; with `resume_step`, the last of that step."""
        lines = read_lines(directory)
        records = [(i, r) for i, r in enumerate(map(parse, lines)) if r is not None]
        steps = sorted({r.step for _, r in records})
        if resume_step is None:
            if lines and parse(lines[-1]) is None:
                where = f"record (line {len(lines)} of {directory / INDEX})"
                problem = f"not a checkpoint record: {lines[-1][:80]!r}"
                fallback = steps[-1] if steps else None
                raise DamagedCheckpointError(
                    damaged_message(model, where, problem, fallback, "delete that line")
                )
            latest = [r for _, r in records if r.step == steps[-1]][-1] if steps else None
            return ResumePoint(latest, lambda: None)
        chosen = [(i, r) for i, r in records if r.step == resume_step]
        if not chosen and resume_step != 0:
            problem = "no checkpoint of that step is recorded"
            raise ValueError(
                resume_step_message(model, resume_step, problem, directory / INDEX, steps)
            )
        keep = chosen[-1][0] + 1 if chosen else 0  # step 0 without a record: the base model
        checkpoint = chosen[-1][1] if chosen else None
        return ResumePoint(checkpoint, lambda: set_aside(directory, lines, keep, resume_step))

    def checkpoint_of(self, directory: Path, step: int) -> str | None:
        records = [r for r in map(parse, read_lines(directory)) if r is not None]
        return next((r.path for r in reversed(records) if r.step == step), None)

    async def save(self, client: TinkerTrainingClient, model: TrainableModel, step: int) -> str:
        """Save weights and optimizer on the service, then index the path with the trainer
        state, checked first. A checkpoint already saved under this step's name belongs to an
        attempt that failed before indexing it (indexed steps are <= the model's step), so it
        is overwritten."""
        settings = model_record(model.directory, model)
        record = {"step": step, "path": "", "run_state": model.run_state, "model": settings}
        try:
            json.dumps(record, allow_nan=False)
        except (TypeError, ValueError) as err:  # json's own type, with what to fix
            raise type(err)(
                f"model {model.name!r}: run_state must be JSON-serialisable (finite numbers) "
                f"to be saved with the checkpoint of step {step}: {err}"
            ) from err
        saved = await client.save_state(f"step-{step:06d}", overwrite=True)
        with open(model.directory / INDEX, "a", encoding="utf-8") as f:
            f.write(json.dumps({**record, "path": saved.path}) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a crash leaves the earlier lines intact
        return saved.path


def parse(line: str) -> Checkpoint | None:
    """The checkpoint a line records, or None if it is not a record."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    step, path, run_state = record.get("step"), record.get("path"), record.get("run_state")
    if type(step) is not int or not isinstance(path, str) or not isinstance(run_state, dict):
        return None
    return Checkpoint(path, step, dict(run_state))


def read_lines(directory: Path) -> list[str]:
    """The index's lines, an unterminated last one dropped (or terminated if whole) and the
    index rewritten, so appends start on a line of their own (read at registration and after
    a failed step, when this process is the index's one writer)."""
    index = directory / INDEX
    text = index.read_text(encoding="utf-8") if index.exists() else ""
    lines = [line for line in text.splitlines() if line.strip()]
    if text and not text.endswith("\n"):
        if lines and parse(lines[-1]) is None:
            lines.pop()
        rewrite(index, lines)
    return lines


def set_aside(directory: Path, lines: list[str], keep: int, resume_step: int) -> None:
    """Move the lines after the first `keep` (those after an explicit `resume_step`) to a file
    of their own, kept as set-aside step directories are, so the steps trained from there on
    are the index's latest."""
    if keep >= len(lines):
        return
    aside = directory / f"checkpoints.set-aside-after-step-{resume_step}-{stamp()}.jsonl"
    aside.write_text("".join(line + "\n" for line in lines[keep:]), encoding="utf-8")
    rewrite(directory / INDEX, lines[:keep])


def rewrite(index: Path, lines: list[str]) -> None:
    """Replace the index with `lines`, atomically."""
    tmp = index.with_name(f".{index.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, index)
