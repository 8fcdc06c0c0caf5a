"""The job's run directory: where it is, whether it may start or resume there, its base model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from posttrain.backends.tinker_index import INDEX as TINKER_INDEX
from posttrain.backends.tinker_index import parse
from posttrain.data.rows import open_rows
from posttrain.engine.checkpoint import step_directories
from posttrain.jobs.config import JobConfig
from posttrain.jobs.job_task import file_digest
from posttrain.jobs.tables import parse_tiny_spec, redact_secrets
from posttrain.models.tiny import make_tiny_model
from posttrain.trainer.config import option_values
from posttrain.trainer.steps import RunState
from posttrain.trainer.token_advantages import TRAINER_RUN_STATE_KEYS

# Settings a resumed run may change: where the run is, how long it goes on, how it is evaluated,
# and where and how its engine runs (not which engine, nor its precision).
RESUMABLE_CHANGES = frozenset(
    {"run.output_dir", "run.name", "run.project", "run.keep_checkpoints", "rl.steps"}
    | {f"inference.{key}" for key in ("devices", "threads", "python", "kv_cache_mb")}
    | {f"inference.{key}" for key in ("url", "api_key", "start_timeout_s")}
    | {"teacher.url", "teacher.api_key"}  # where the same teacher is served
    # Where the same judge is served, and what a step may spend on it.
    | {f"judge.{key}" for key in ("base_url", "api_key_env", "max_calls_per_step")}
    | {f"judge.{key}" for key in ("max_seconds_per_step", "retries", "backoff_s")}
    | {f"judge.{key}" for key in ("max_concurrency", "timeout_s")}
    | {"reward_model.batch_size", "reward_model.device"}
)
JOB_FILE = "job.json"
# In job.json only when the config has them.
OPTIONAL_TABLES = ("task", "data", "environment", "teacher", "judge", "reward_model")
# Tables posttrain added after runs began: a run's job.json without one ran at its defaults.
LATER_TABLES = ("inference",)
# job.json's record of the resolved task (`ResolvedTask.record()`): spec, kind, target, ...
RESOLVED_KEY = "resolved_task"
# ... or of the resolved environment (`ResolvedEnvironment.record()`): spec, kind, target.
RESOLVED_ENVIRONMENT_KEY = "resolved_environment"
# What a dataset task's record (RESOLVED_KEY) keeps of each data source, by kind of source.
DIGEST_KINDS = ("sha256", "fingerprint")
# job.json's record of `[dpo]` (`dpo_record`), null for a job without one.
DPO_KEY = "dpo"


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
        if "trainer" in values:  # [sft] and [rl]: their train options are keys of the table
            del values["trainer"]
            values.update(option_values(getattr(config, table).trainer))
        record[table] = values
    # For the record (a resume may run elsewhere), without the secrets it may hold.
    record["backend"] = redact_secrets(config.backend)
    record["inference"] = redact_secrets(asdict(config.inference))
    # Only when set, so the job.json of a run from before these tables still compares equal.
    if config.task:
        record["task"] = dict(config.task)
    if config.data is not None:
        record["data"] = asdict(config.data)
    if config.environment:
        record["environment"] = dict(config.environment)
    if config.teacher is not None:
        record["teacher"] = redact_secrets(asdict(config.teacher))
    if config.judge is not None:
        record["judge"] = asdict(config.judge)
    if config.reward_model is not None:
        record["reward_model"] = asdict(config.reward_model)
    return record


def config_changes(saved: Mapping[str, object], record: dict[str, dict[str, object]]) -> list[str]:
    """How `record` differs from the run's saved job.json, in the settings a resume keeps."""
    changed = [
        f"[{table}]: in the run's {JOB_FILE}, not in the config now"
        for table in OPTIONAL_TABLES
        if table in saved and table not in record
    ]
    # A key added to posttrain after the run started, left at its default, changes nothing.
    defaults = config_record(JobConfig())
    for table, values in record.items():
        if table in ("eval", "backend"):  # where and how a run is evaluated may change
            continue
        if table not in saved and table not in LATER_TABLES:
            changed.append(f"[{table}]: not in the run's {JOB_FILE}")
            continue
        saved_table = saved.get(table, {})
        assert isinstance(saved_table, dict)
        for key, value in values.items():
            if f"{table}.{key}" in RESUMABLE_CHANGES:
                continue
            if key not in saved_table and defaults.get(table, {}).get(key, value) == value:
                continue
            if key not in saved_table:
                changed.append(f"[{table}] {key}: not in the run's {JOB_FILE}, {value!r} now")
            elif saved_table[key] != value:
                changed.append(f"[{table}] {key}: {saved_table[key]!r} in the run, {value!r} now")
    return changed


def prepare_run_dir(
    run_dir: Path,
    config: JobConfig,
    *,
    resume: bool,
    task: Mapping[str, object] | None = None,
    environment: Mapping[str, object] | None = None,
) -> Path:
    """A fresh run needs a directory without checkpoints; a resumed one the same settings and,
    for a dataset task, the same data files (`task` is `ResolvedTask.record()`, kept in
    job.json under RESOLVED_KEY; `environment`, `ResolvedEnvironment.record()`, under
    RESOLVED_ENVIRONMENT_KEY)."""
    record: dict[str, object] = dict(config_record(config))
    if resume:
        saved = json.loads((run_dir / JOB_FILE).read_text())
        changed = config_changes(saved, config_record(config))
        changed += data_changes(saved.get(RESOLVED_KEY), task)
        changed += dpo_changes(saved, dpo_record(config))
        if changed:
            raise ValueError(
                f"cannot resume {run_dir} with a different config (only [rl] steps, [eval] and "
                "where the run lives may change): " + "; ".join(changed)
            )
        return run_dir
    record[DPO_KEY] = dpo_record(config)
    if task is not None:
        record[RESOLVED_KEY] = dict(task)
    if environment is not None:
        record[RESOLVED_ENVIRONMENT_KEY] = dict(environment)
    held = held_checkpoint(run_dir)
    if held is not None:
        raise ValueError(
            f"{run_dir} already holds a run ({held}); continue it with "
            f"`posttrain train CONFIG --resume {run_dir}`, or set another [run] name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "history.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / JOB_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return run_dir


def held_checkpoint(run_dir: Path) -> str | None:
    """The run's latest checkpoint, in words, if `run_dir` holds one: a step directory
    (LocalBackend, RayBackend; complete or damaged: a damaged one is a run's too, not a fresh
    start), or a line of TinkerBackend's index of checkpoints on its service."""
    steps = step_directories(run_dir / "checkpoints")
    if steps:
        return f"checkpoint {steps[-1].name}"
    index = run_dir / TINKER_INDEX
    lines = index.read_text(encoding="utf-8").splitlines() if index.is_file() else []
    records = [line for line in lines if line.strip()]
    if records:
        found = parse(records[-1])
        step = f"step {found.step}" if found is not None else "a record"
        return f"{TINKER_INDEX} names the checkpoint of {step}"
    return None


def data_changes(saved: object, task: Mapping[str, object] | None) -> list[str]:
    """Which data sources of a dataset task differ from the run's: by sha256 (a file, or a
    directory's files) or by fingerprint (a hub dataset)."""
    if not isinstance(saved, dict) or task is None:
        return []
    changed: list[str] = []
    for kind in DIGEST_KINDS:
        before, now = saved.get(kind), task.get(kind, {})
        if not isinstance(before, dict) or not isinstance(now, dict):
            continue
        what = "file" if kind == "sha256" else "hub dataset"  # a directory is a file here
        changed += [
            f"[data] {key}: the {what} changed since the run started ({kind} {before[key][:12]}"
            f"... then, {now.get(key, 'no such ' + kind)[:12]}... now); resuming would train "
            "on other problems"
            for key in before
            if before[key] != now.get(key)
        ]
    return changed


def dpo_record(config: JobConfig) -> dict[str, object] | None:
    """`[dpo]` as job.json keeps it: `data`, its train_dpo options, and `data_sha256`, the
    sha256 of the data file (None if it is missing: the DPO phase then says so)."""
    if config.dpo is None:
        return None
    path = config.dpo_path()
    digest = _dpo_digest(path) if path is not None else None
    return {"data": config.dpo.data, **option_values(config.dpo.trainer), "data_sha256": digest}


def _dpo_digest(path: Path | str) -> str | None:
    """A file's or directory's sha256, or a hub dataset's fingerprint; None if it is missing or
    does not load (the DPO phase then says why)."""
    if isinstance(path, Path):
        return file_digest(path) if path.exists() else None
    try:
        return open_rows(path, what="DPO dataset").digest()[1]
    except (ValueError, ImportError, OSError):
        return None


def dpo_changes(saved: Mapping[str, object], now: dict[str, object] | None) -> list[str]:
    """How `[dpo]` differs from the run's: its presence, an option, or its data file's bytes
    (its path may change). A job.json from before [dpo] was recorded has no DPO_KEY."""
    if DPO_KEY not in saved:
        return []
    before = saved[DPO_KEY]
    if before is None or now is None:
        if before == now:
            return []
        return [
            f"[dpo]: {'not ' if before is None else ''}in the run's {JOB_FILE}, "
            f"{'not ' if now is None else ''}in the config now"
        ]
    assert isinstance(before, dict)
    changed = [
        f"[dpo] {key}: {before.get(key)!r} in the run, {now.get(key)!r} now"
        for key in sorted({*before, *now} - {"data", "data_sha256"})
        if before.get(key) != now.get(key)
    ]
    then, digest = before.get("data_sha256"), now["data_sha256"]
    if then != digest:
        changed.append(
            f"[dpo] data: the file changed since the run started (sha256 {str(then)[:12]}... "
            f"then, {str(digest)[:12]}... now); resuming would train on other pairs"
        )
    return changed


def resolve_base_model(spec: str, run_dir: Path, *, into: str = "base_model") -> Path | str:
    """`tiny:<arch>:<size>[:<init seed, default 0>]` is built once into the run directory (as
    `into`); anything else is a local directory or a hub id, passed on as is."""
    if not spec.startswith("tiny:"):
        return spec
    arch, size, seed = parse_tiny_spec(spec)
    path = run_dir / into
    if not path.is_dir():
        # Built aside and renamed, so a crash never leaves a half-written base model behind.
        partial = run_dir / f"{into}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        make_tiny_model(partial, arch=arch, size=size, seed=seed or 0)  # pyright: ignore[reportArgumentType]
        partial.rename(path)
    # Absolute, so it loads whatever directory a resume runs from; model.json names it
    # relative to the run (`./base_model`), so the run directory can be moved or copied.
    return path.resolve()


@dataclass
class JobState:
    """What the job keeps in `model.run_state`, saved with every checkpoint: its data cursor.

    The prompts and sampling seed of RL step k derive from (seed, k), so the number of RL
    steps done is the whole cursor. The trainer keeps its own entries beside it (the SEPA
    controller's state, `TRAINER_RUN_STATE_KEYS`).
    """

    sft_done: bool = False
    dpo_done: bool = False
    accuracy_before: float | None = None  # held-out accuracy before RL, once measured
    rl_steps_done: int = 0

    @classmethod
    def load(cls, run_state: Mapping[str, object]) -> JobState:
        """From a checkpoint's run_state (empty for a fresh run)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(run_state) - known - TRAINER_RUN_STATE_KEYS)
        if unknown:
            raise ValueError(
                f"the checkpoint's run_state has keys this job does not know: {unknown}; it was "
                "not written by `posttrain train`"
            )
        return cls(**{k: v for k, v in run_state.items() if k in known})  # pyright: ignore[reportArgumentType]

    def save(self, run_state: RunState) -> None:
        """Into `model.run_state`, to go with the next checkpoint."""
        run_state.update(asdict(self))
