"""The job's run directory: where it is, whether it may start or resume there, its base model."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from posttrain.engine.checkpoint import list_checkpoints
from posttrain.engine.tiny import make_tiny_model
from posttrain.jobs.config import JobConfig, parse_tiny_spec

# Settings a resumed run may change: where the run is, how long it goes on, how it is evaluated.
RESUMABLE_CHANGES = frozenset(
    {"run.output_dir", "run.name", "run.project", "run.keep_checkpoints", "rl.steps"}
)
JOB_FILE = "job.json"


def locate_run(config: JobConfig, resume: str | Path | None) -> tuple[Path, str, str]:
    """(backend path, project, name): from the config, or from the run directory to resume."""
    if resume is None:
        return Path(config.run.output_dir), config.run.project, config.run.name
    run_dir = Path(resume)
    if not (run_dir / JOB_FILE).is_file() or run_dir.parent.name != "models":
        raise ValueError(
            f"--resume {str(run_dir)!r} is not a run directory: expected "
            f"<output_dir>/<project>/models/<name>/ holding {JOB_FILE}, as printed by the run"
        )
    return run_dir.parent.parent.parent, run_dir.parent.parent.name, run_dir.name


def config_record(config: JobConfig) -> dict[str, dict[str, object]]:
    """The config as nested JSON, with the trainer options flattened into their table."""
    record: dict[str, dict[str, object]] = {}
    for table in ("run", "model", "sft", "rl", "eval"):
        values = asdict(getattr(config, table))
        values.update(values.pop("trainer", {}))
        record[table] = values
    return record


def prepare_run_dir(run_dir: Path, config: JobConfig, *, resume: bool) -> Path:
    """A fresh run needs a directory without checkpoints; a resumed one the same settings."""
    record = config_record(config)
    if resume:
        saved = json.loads((run_dir / JOB_FILE).read_text())
        changed = [
            f"[{table}] {key}: {saved.get(table, {}).get(key)!r} in the run, {value!r} now"
            for table, values in record.items()
            for key, value in values.items()
            if f"{table}.{key}" not in RESUMABLE_CHANGES
            and table != "eval"
            and saved.get(table, {}).get(key) != value
        ]
        if changed:
            raise ValueError(
                f"cannot resume {run_dir} with a different config (only [rl] steps, [eval] and "
                "where the run lives may change): " + "; ".join(changed)
            )
        return run_dir
    checkpoints = list_checkpoints(run_dir / "checkpoints") if run_dir.is_dir() else []
    if checkpoints:
        raise ValueError(
            f"{run_dir} already holds a run (checkpoint {checkpoints[-1].name}); continue it with "
            f"`posttrain train CONFIG --resume {run_dir}`, or set another [run] name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "history.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / JOB_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return run_dir


def resolve_base_model(spec: str, run_dir: Path) -> Path | str:
    """`tiny:<arch>:<size>[:<init seed, default 0>]` is built once into the run directory; anything else is a
    local directory or a hub id, passed on as is."""
    if not spec.startswith("tiny:"):
        return spec
    arch, size, seed = parse_tiny_spec(spec)
    path = run_dir / "base_model"
    if not path.is_dir():
        # Built aside and renamed, so a crash never leaves a half-written base model behind.
        partial = run_dir / "base_model.partial"
        shutil.rmtree(partial, ignore_errors=True)
        make_tiny_model(partial, arch=arch, size=size, seed=seed or 0)  # type: ignore[arg-type]
        partial.rename(path)
    # Absolute, so model.json names the same base model whatever directory a resume runs from.
    return path.resolve()
