"""`posttrain explain CONFIG [--json]`: the resolved job, its task (or environment), backend,
sampling engine, preflight and plan. `posttrain explain --key TABLE[.KEY]`: the help line and
default of a TOML key (`rl.steps`, `rl.loss`), or of every key of a table.

Nothing is built or trained. Exit status: 0 when the job can run, 1 when preflight refuses
it, 2 when the config itself (or the key) cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from pathlib import Path

from posttrain.backends.plugins.registry import BackendInfo
from posttrain.cli.engine_table import (
    OPENAI_PROBED,
    accepts_inference,
    mode_of,
    sync_route,
    where,
)
from posttrain.clients.teacher import Teacher
from posttrain.environments.resolve import ResolvedEnvironment
from posttrain.finder import did_you_mean
from posttrain.inference import InferenceConfig
from posttrain.jobs.backend import (
    PLAIN_CALLS,
    JobProblem,
    job_problems,
    planned_rl_options,
    work_problems,
)
from posttrain.jobs.config import JobConfig, key_help, load_config
from posttrain.jobs.tables import redact_secrets
from posttrain.tasks.resolve import ResolvedTask
from posttrain.tokenizer import Tokenizer
from posttrain.trainer.config import is_config, option_values
from posttrain.trainer.parity import describe_parity

# What each plan entry counts.
PLAN_NOTES = {
    "sft_examples": "task problems with their reference solution ([sft] examples)",
    "sft_dataset_rows": "conversations in the [sft] dataset file",
    "sft_optimizer_steps": "ceil((examples + dataset rows) / batch_size) x epochs",
    "rl_steps": "RL steps, one backend.train call each",
    "rl_prompts_per_step": "prompts sampled per RL step",
    "rl_group_size": "completions per prompt",
    "rl_completions_per_step": "prompts_per_step x group_size trajectories per step",
    "rl_optimizer_steps_per_step": (
        "optimizer steps per backend.train call (num_minibatches x update_epochs; a critic "
        "takes as many)"
    ),
    "rl_sampled_tokens_per_step_max": "completions x max_tokens: sampled tokens at most",
    "rl_prompt_tokens_per_step_estimate": "prompt tokens of step 1's prompts x group_size (each "
    "completion is trained with its prompt); null without a local tokenizer",
    "rl_trained_tokens_per_step_max_estimate": "prompt estimate + sampled maximum: tokens in "
    "one step's forward/backward passes, at most",
    "held_out_problems": "greedy evaluation problems, before RL, every [eval] every steps, after "
    "([eval] held_out, or all a dataset task has if fewer); null when the task does not resolve",
}
# What each plan entry counts for a job on an environment ([run] environment).
ENVIRONMENT_PLAN_NOTES = {
    **PLAN_NOTES,
    "sft_examples": "solved episodes of training seeds (the environment's demonstration(), "
    "[sft] examples)",
    "rl_prompts_per_step": "environment seeds per RL step",
    "rl_group_size": "episodes per seed",
    "rl_completions_per_step": "prompts_per_step x group_size episodes (trajectories) per step",
    "rl_sampled_tokens_per_step_max": "episodes x max_turns x max_tokens: sampled tokens at most",
    "rl_prompt_tokens_per_step_estimate": "null: an environment's messages are known only once "
    "its episodes run",
    "rl_trained_tokens_per_step_max_estimate": "null, as the prompt estimate",
    "held_out_problems": "greedy evaluation episodes on held-out seeds ([eval] held_out), "
    "before RL, every [eval] every steps, after",
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("explain", help="show a job's resolved config, backend and plan")
    parser.add_argument("config", type=Path, nargs="?", help="the job's TOML file")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--key", metavar="TABLE[.KEY]", help="show the help of a TOML key, or of a table's keys"
    )
    parser.set_defaults(handler=run)


def key_lines(spec: str) -> list[str]:
    """`[table] key = default  # help` for `table.key`, or for each key of `table`."""
    table, _, key = spec.partition(".")
    keys = key_help(table)
    if key and key not in keys:
        raise ValueError(f"[{table}] has no key {key!r}{did_you_mean(key, keys)}")
    chosen = [key] if key else list(keys)
    return [f"[{table}] {k} = {keys[k][1]!r}  # {keys[k][0]}" for k in chosen]


def _jsonable(value: object) -> object:
    if isinstance(value, Teacher):
        return value.name  # the job's [teacher], named (`planned_rl_options`)
    if is_config(value):
        # A table's keys and its train() options, flat by the keys the TOML tables use;
        # canonical: `loss` is the loss that runs.
        return {key: _jsonable(v) for key, v in option_values(value).items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, frozenset | set):
        return sorted(map(str, value))
    if isinstance(value, Path):
        return str(value)
    return value


def load_tokenizer(config: JobConfig) -> Tokenizer | None:
    """The base model's tokenizer without building or downloading anything, else None."""
    spec = config.model.base_model
    if spec.startswith("tiny:"):
        from posttrain.models.tiny import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    from posttrain.models.source import cached_model_source

    try:
        source = cached_model_source(spec)  # None: a GGUF or packaged model not converted yet
        return AutoTokenizer.from_pretrained(source, local_files_only=True) if source else None
    except (OSError, ValueError):
        return None


def dataset_rows(config: JobConfig, tokenizer: Tokenizer | None) -> int:
    """Conversations in `[sft] dataset`: read as the job reads them when the tokenizer is at
    hand, else its rows (a JSONL file's non-blank lines)."""
    path = config.dataset_path()
    if path is None:
        return 0
    if tokenizer is None:
        from posttrain.data.rows import open_rows

        return len(open_rows(path, what="SFT dataset"))
    from posttrain.jobs.train_job import sft_fields
    from posttrain.rollouts.sft_data import load_sft_dataset

    return len(load_sft_dataset(path, tokenizer, fields=sft_fields(config.data)))


def prompt_tokens(
    config: JobConfig, task: ResolvedTask | None, tokenizer: Tokenizer | None
) -> int | None:
    """Prompt tokens of RL step 1's prompts, rendered as the job renders them."""
    if tokenizer is None or task is None:
        return None
    from posttrain.rollouts.evaluation import prompt_builders
    from posttrain.rollouts.task_rollouts import derive_seed
    from posttrain.tokenizer import assistant_closing

    rng = random.Random(derive_seed(config.run.seed, "rl", 0))  # as the job draws step 1
    problems = task.task.make_prompts(rng, config.rl.prompts_per_step)
    builders = prompt_builders(tokenizer, problems, assistant_closing(tokenizer))
    return sum(len(b.tokens) for b in builders)


def plan(
    config: JobConfig, task: ResolvedTask | ResolvedEnvironment | None = None
) -> tuple[dict[str, int | None], list[JobProblem]]:
    """Step counts, batch shape and tokens per step the job will run (see PLAN_NOTES, and
    ENVIRONMENT_PLAN_NOTES for a job on an environment)."""
    tokenizer = load_tokenizer(config)
    problems: list[JobProblem] = []
    try:
        rows = dataset_rows(config, tokenizer)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        rows = 0
        problems.append(JobProblem("train_sft", "[sft] dataset", str(exc)))
    sft = config.sft.trainer
    total = config.sft.examples + rows
    completions = config.rl.prompts_per_step * config.rl.group_size
    sampled = completions * config.rl.max_tokens
    if isinstance(task, ResolvedEnvironment) or config.run.environment is not None:
        sampled *= config.rl.max_turns
        prompts, held_out = None, config.eval.held_out
    else:
        prompts = prompt_tokens(config, task, tokenizer)
        held_out = len(task.task.held_out(config.eval.seed, config.eval.held_out)) if task else None
    prompt_estimate = prompts * config.rl.group_size if prompts is not None else None
    return {
        "sft_examples": config.sft.examples,
        "sft_dataset_rows": rows,
        "sft_optimizer_steps": math.ceil(total / sft.batch_size) * sft.epochs,
        "rl_steps": config.rl.steps,
        "rl_prompts_per_step": config.rl.prompts_per_step,
        "rl_group_size": config.rl.group_size,
        "rl_completions_per_step": completions,
        "rl_optimizer_steps_per_step": (
            config.rl.trainer.num_minibatches * config.rl.trainer.update_epochs
        ),
        "rl_sampled_tokens_per_step_max": sampled,
        "rl_prompt_tokens_per_step_estimate": prompt_estimate,
        "rl_trained_tokens_per_step_max_estimate": (
            prompt_estimate + sampled if prompt_estimate is not None else None
        ),
        "held_out_problems": held_out,
    }, problems


def _backend(config: JobConfig, info: BackendInfo | None) -> dict[str, object]:
    if info is None:
        return {"name": config.run.backend, "resolved": False}
    return {
        "name": info.name,
        "target": info.target,
        "source": info.source,
        "resolved": True,
        "importable": info.importable,
        "constructor_options": redact_secrets(config.backend),
        "capabilities_source": info.capabilities_source,
        "capabilities": info.capabilities.as_dict(),
    }


def _engine(config: JobConfig, info: BackendInfo | None) -> dict[str, object]:
    """Which engine samples, where, what it can do and what each step syncs to it."""
    # getattr: a JobConfig from before the [inference] table samples with the default engine.
    inference: InferenceConfig = getattr(config, "inference", None) or InferenceConfig()
    mode = mode_of(inference)
    described = mode.as_dict()
    record = {"engine": described.pop("engine"), "where": where(inference), **described}
    model = config.model
    record["sync"] = sync_route(inference, model.lora_rank, model.train_unembed)
    if mode.probed:
        record["capabilities_note"] = OPENAI_PROBED
    live = inference.placement == "here"
    record["parity_check"] = describe_parity(
        inference.parity_check,
        config.model.dtype,
        None if live else inference.dtype,
        fixed=inference.fixed_policy,
    )
    # False: the backend cannot take inference= and samples its own way (null: not imported).
    record["backend_accepts_inference"] = accepts_inference(info) if info is not None else None
    return record


def _config(config: JobConfig) -> object:
    """The resolved config as it may be shown: [rl] with the train options the job runs (its
    [teacher] among them), secrets (in [backend], [inference], [teacher]) redacted."""
    rl = dataclasses.replace(config.rl, trainer=planned_rl_options(config))
    shown = _jsonable(dataclasses.replace(config, rl=rl, backend=redact_secrets(config.backend)))
    for table in ("inference", "teacher"):
        if isinstance(shown, dict) and isinstance(shown.get(table), dict):
            shown[table] = redact_secrets(shown[table])
    return shown


def _work(config: JobConfig, work: ResolvedTask | ResolvedEnvironment | None) -> dict[str, object]:
    """The `task` (or `environment`) entry: what the job trains on, resolved or not."""
    if config.run.environment is not None:
        record = work.record() if work is not None else {"spec": config.run.environment}
        return {"environment": {**record, "resolved": work is not None}}
    if work is None:
        return {"task": {"spec": config.run.task, "resolved": False}}
    return {"task": work.record()}


def _base_model(spec: str) -> dict[str, object]:
    """The base model spec; for a .gguf or packaged model whether it is converted yet; and,
    where its config is at hand without a download, its family and the paths that apply."""
    from posttrain.jobs.backend import base_model_config
    from posttrain.models.cache import ModelSourceError
    from posttrain.models.families import describe
    from posttrain.models.source import cache_note

    try:
        note = cache_note(spec)
    except (ModelSourceError, OSError):  # preflight reports what is wrong with it
        note = None
    out: dict[str, object] = {"spec": spec} if note is None else {"spec": spec, "cache": note}
    found = base_model_config(spec)
    if found is not None:
        out["family"] = describe(found)
    return out


def explain(config: JobConfig) -> dict[str, object]:
    found, problems = job_problems(config)
    work, more = work_problems(config)
    problems += more
    info = found.info if found is not None else None
    steps, plan_problems = plan(config, work)
    problems += plan_problems
    notes = PLAN_NOTES if config.run.environment is None else ENVIRONMENT_PLAN_NOTES
    return {
        "config": _config(config),
        "base_model": _base_model(config.model.base_model),
        **_work(config, work),
        "backend": _backend(config, info),
        "engine": _engine(config, info),
        "preflight": {
            "ok": not problems,
            "problems": [
                {"call": p.call, "option": p.option, "message": p.message} for p in problems
            ],
        },
        "plan": steps,
        "plan_notes": notes,
    }


def _print_table(title: str, rows: dict[str, object], indent: str = "  ") -> None:
    print(title)
    for key, value in rows.items():
        if isinstance(value, dict) and value:
            _print_table(f"{indent}{key}:", value, indent + "  ")
        else:
            print(f"{indent}{key} = {value!r}")


def _section(report: dict[str, object], key: str) -> dict[str, object]:
    """One table of the report `explain` built (each of its values is a dict)."""
    section = report[key]
    assert isinstance(section, dict)
    return section


def _print(path: Path, report: dict[str, object]) -> None:
    _print_table(f"config ({path}):", _section(report, "config"))
    _print_table("base model:", _section(report, "base_model"))
    for what in ("task", "environment"):
        if what in report:
            _print_table(f"{what}:", _section(report, what))
    _print_table("backend:", _section(report, "backend"))
    _print_table("sampling engine:", _section(report, "engine"))
    preflight = _section(report, "preflight")
    print("preflight: ok" if preflight["ok"] else "preflight: problems")
    problems = preflight["problems"]
    assert isinstance(problems, list)
    for p in problems:
        where = p["option"] if p["call"] in PLAIN_CALLS else f"{p['call']}() {p['option']}"
        print(f"  - {where}: {p['message']}")
    print("plan:")
    notes = _section(report, "plan_notes")
    for key, value in _section(report, "plan").items():
        print(f"  {key} = {value!r}  # {notes[key]}")


def run(args: argparse.Namespace) -> int:
    if args.key is not None:
        try:
            print("\n".join(key_lines(args.key)))
        except ValueError as exc:
            print(f"posttrain explain: error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.config is None:
        print("posttrain explain: error: give the job's TOML file (or --key)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"posttrain explain: error: {exc}", file=sys.stderr)
        return 2
    report = explain(config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(args.config, report)
    return 0 if _section(report, "preflight")["ok"] else 1
