"""The job's backend: found through the registry from `[run] backend`, built with `[backend]`
as its constructor's keyword arguments, checked before any work, and given only the options
it declares.

The job calls `Factory(path=<[run] output_dir>, keep_checkpoints=<[run] keep_checkpoints>,
**[backend])`, passing `path` and `keep_checkpoints` only to a constructor that has them, and
`inference=<[inference]>` when the config sets one (a constructor without it is a problem).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from posttrain.backends.engine_options import trainer_device
from posttrain.backends.plugins.registry import BackendInfo, Factory, describe, load
from posttrain.backends.plugins.schema import (
    OptionSchema,
    ParameterSchema,
    constructor_hints,
    constructor_parameters,
)
from posttrain.backends.preflight import (
    PreflightError,
    preflight_dpo,
    preflight_rl,
    preflight_sft,
)
from posttrain.backends.protocol import TrainableBackend
from posttrain.backends.register_checks import model_problems
from posttrain.clients.custom_loss import custom_loss
from posttrain.engine.devices import AUTO, resolve_device, resolve_worker_device
from posttrain.environments.resolve import ResolvedEnvironment
from posttrain.finder import DOTTED_PATH, did_you_mean
from posttrain.inference.adapters import lora_sync_problem, planned_layers
from posttrain.inference.config import InferenceConfig, head_problem
from posttrain.jobs.config import JobConfig, TeacherConfig
from posttrain.jobs.job_task import JobTaskError, resolve_job_environment, resolve_job_task
from posttrain.jobs.tables import REDACTED, is_secret
from posttrain.jobs.teacher import is_checkpoint, planned_teacher
from posttrain.models.cache import HubUnreachableError, ModelSourceError
from posttrain.models.source import check_base_model
from posttrain.tasks.resolve import ResolvedTask
from posttrain.trainer.config import RLConfig, SFTConfig, check_value, option_values, with_options

# Constructor arguments the job fills in itself, and where their value comes from.
JOB_SUPPLIED = {
    "path": "[run] output_dir",
    "keep_checkpoints": "[run] keep_checkpoints",
    "inference": "the [inference] table",
}
PLAIN_CALLS = ("model", "task", "backend")  # problems named by their option alone
Call = Literal["model", "task", "backend", "train", "train_sft", "train_dpo"]


@dataclass(frozen=True)
class JobProblem:
    """Something that stops the job, found before any work: in its base model (`call` is
    "model"), its task ("task"), the backend itself ("backend") or in the options one of its
    calls would get."""

    call: Call
    option: str
    message: str

    def __str__(self) -> str:
        where = self.option if self.call in PLAIN_CALLS else f"{self.call}() {self.option}"
        if self.message.startswith(f"{self.option} = "):  # register's own message names it
            return self.message if where == self.option else f"{self.call}() {self.message}"
        return f"{where}: {self.message}"


class JobPreflightError(ValueError):
    def __init__(self, problems: Sequence[JobProblem]) -> None:
        self.problems = list(problems)
        super().__init__("the job cannot start:\n" + "\n".join(f"  - {p}" for p in problems))


def constructor_kwargs(
    config: JobConfig, factory: Factory, path: Path, declared: Sequence[ParameterSchema] = ()
) -> dict[str, object]:
    """Keyword arguments for the backend's constructor; errors name the `[backend]` key.
    `declared` is the constructor as the registry describes it: options a plugin's option
    schema declares are checked (type, choices, validator), and their defaults passed."""
    spec = config.run.backend
    params = constructor_parameters(factory)
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    options = {p.name: p.option for p in declared if p.option is not None}
    # A constructor taking **kwargs that declares its options takes only those, as in retrain.
    open_ended = any(p.kind == p.VAR_KEYWORD for p in params.values()) and not options
    accepted = [*named, *(n for n in options if n not in named)]
    hints = constructor_hints(factory)
    for key, value in config.backend.items():
        if key in JOB_SUPPLIED:
            raise ValueError(
                f"[backend] {key}: the job sets it from {JOB_SUPPLIED[key]}; set it there instead"
            )
        if key not in accepted and not open_ended:
            takes = ", ".join(n for n in accepted if n not in JOB_SUPPLIED) or "nothing"
            raise ValueError(
                f"[backend] unknown key {key!r} for backend {spec!r}{did_you_mean(key, accepted)} "
                f"(its constructor takes: {takes})"
            )
        if key in hints:
            _check_type(key, hints[key], value)
        if key in options and (problem := options[key].problem(value)) is not None:
            shown = REDACTED if is_secret(key) else value
            raise ValueError(
                f"[backend] {key}={shown!r} is invalid: {problem} "
                f"(declared by {options[key].declared_by})"
            )
    kwargs: dict[str, object] = {}
    if "path" in named:
        kwargs["path"] = path
    if "keep_checkpoints" in named:
        kwargs["keep_checkpoints"] = config.run.keep_checkpoints
    for row in declared:
        own = named.get(row.name)
        own_default = own is not None and own.default is not own.empty
        if row.option is not None and not row.required and not own_default:
            kwargs[row.name] = row.default  # declared, but the constructor has no default
    kwargs.update(config.backend)
    if config.inference != InferenceConfig() and "inference" in named:  # else `_inference_problems`
        inference = config.inference
        ahead = config.rl.max_off_policy_steps
        if inference.keep_versions is None and ahead > 1:  # each sample in flight keeps its own
            inference = replace(inference, keep_versions=inference.versions_kept(ahead))
        kwargs["inference"] = inference
    missing = [
        n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in kwargs
    ]
    if missing:
        raise ValueError(
            f"[backend] backend {spec!r} needs {', '.join(map(repr, missing))}: add "
            f"{' and '.join(f'{m} = ...' for m in missing)} to the [backend] table"
        )
    return kwargs


def _check_type(key: str, annotation: object, value: object) -> None:
    try:
        check_value(key, annotation, value)
    except ValueError as exc:
        message = str(exc).replace(repr(value), repr(REDACTED)) if is_secret(key) else str(exc)
        raise ValueError(f"[backend] {message}") from None
    except TypeError:  # an annotation isinstance cannot check (Any, generics): the constructor will
        pass


@dataclass(frozen=True)
class JobBackend:
    """The job's backend as `job_problems` found it: `create_backend` builds it from this
    without resolving, importing or checking it again."""

    info: BackendInfo
    factory: Factory | None  # None: it cannot be imported
    kwargs: dict[str, object] | None  # its constructor's arguments; None: `[backend]` is wrong


def create_backend(found: JobBackend) -> TrainableBackend:
    """Build the backend that `job_problems` found and reported no problem with."""
    if found.factory is None or found.kwargs is None:
        raise ValueError(f"{found.info.name!r} has problems; job_problems names them")
    backend = found.factory(**found.kwargs)
    if not isinstance(backend, TrainableBackend):
        raise ValueError(
            f"[run] backend {found.info.name!r}: {found.info.label}(...) returned a "
            f"{type(backend).__name__}, which lacks register/train/train_sft/sampling_client/close"
        )
    return backend


def job_problems(
    config: JobConfig, *, resume: bool = False, path: Path | None = None, base_model: bool = True
) -> tuple[JobBackend | None, list[JobProblem]]:
    """Everything that would stop this job, found without building anything: the base model
    (unless `base_model=False`), the backend (name, import, hooks), its `[backend]` options,
    what the job needs of it (sampling, SFT, resume) and preflight of the options each call
    would get. `path` is where the backend keeps its models, `[run] output_dir` unless given.
    The backend is None when its name does not resolve."""
    spec = config.run.backend
    base = base_model_problems(config.model.base_model) if base_model else []
    if base_model and config.teacher is not None:
        base += teacher_problems(config.teacher)
    try:
        info = describe(spec, config.backend)  # hooks that take the backend options get them
        factory = load(spec) if info.importable else None
    except (ValueError, ImportError) as exc:
        return None, [*base, JobProblem("backend", "[run] backend", str(exc))]
    if factory is None:
        install = f"; install it with pip install 'posttrain[{info.extra}]'" if info.extra else ""
        message = f"{spec!r} cannot be imported: {info.import_error}{install}"
        problem = JobProblem("backend", "[run] backend", message)
        return JobBackend(info, None, None), [*base, problem]
    problems = base
    problems += [
        JobProblem("model", f"[model] {p.option}", p.message)
        for p in model_problems(info.label, info.capabilities, config.model.lora_rank)
    ]
    try:
        kwargs = constructor_kwargs(
            config, factory, path or Path(config.run.output_dir), info.constructor
        )
    except ValueError as exc:
        kwargs = None
        problems.append(JobProblem("backend", "[backend]", str(exc)))
    problems += _device_problems(info, kwargs or {})
    problems += _inference_problems(info, config, factory, kwargs or {})
    problems += _needs(info, config, resume)
    _load_custom_loss(config)
    rl = planned_rl_options(config)
    problems += _preflight(
        "train",
        lambda: preflight_rl(info.label, info.capabilities, rl, options=info.train_options),
    )
    if config.sft.enabled:
        problems += _preflight(
            "train_sft",
            lambda: preflight_sft(
                info.label, info.capabilities, config.sft.trainer, options=info.train_sft_options
            ),
        )
    if config.dpo is not None:
        dpo, written = config.dpo.trainer, config.dpo.written
        problems += _preflight(
            "train_dpo",
            lambda: preflight_dpo(info.label, dpo, options=info.train_dpo_options, written=written),
        )
    return JobBackend(info, factory, kwargs), problems


def task_problems(config: JobConfig) -> tuple[ResolvedTask | None, list[JobProblem]]:
    """The job's task, resolved (`resolve_job_task`), or the problem that stops it."""
    try:
        return resolve_job_task(config), []
    except JobTaskError as exc:
        return None, [_task_problem(exc)]


def environment_problems(
    config: JobConfig,
) -> tuple[ResolvedEnvironment | None, list[JobProblem]]:
    """The job's environment, resolved (`resolve_job_environment`), or the problem that
    stops it."""
    try:
        return resolve_job_environment(config), []
    except JobTaskError as exc:
        return None, [_task_problem(exc)]


def work_problems(
    config: JobConfig,
) -> tuple[ResolvedTask | ResolvedEnvironment | None, list[JobProblem]]:
    """What the job trains on: its environment when `[run] environment` is set, else its task."""
    if config.run.environment is not None:
        return environment_problems(config)
    return task_problems(config)


def _task_problem(exc: JobTaskError) -> JobProblem:
    where = f" (config {exc.source})" if exc.source is not None else ""
    return JobProblem("task", exc.option, f"{exc.detail}{where}")


def planned_rl_options(config: JobConfig) -> RLConfig:
    """`[rl]`'s train options as preflight judges them: with `[teacher]`, a teacher (named,
    not loaded), so the distillation options are judged as the job will run them."""
    if config.teacher is None:
        return config.rl.trainer
    return with_options(config.rl.trainer, teacher=planned_teacher(config.teacher))


def teacher_problems(teacher: TeacherConfig) -> list[JobProblem]:
    """`[teacher] model` can be had here, as `[model] base_model` (a run's checkpoint is a
    directory); a server's teacher is found when the job starts."""
    if teacher.model is None or is_checkpoint(teacher.model):
        return []
    return [
        JobProblem("model", "[teacher] model", p.message)
        for p in base_model_problems(teacher.model)
    ]


def base_model_problems(spec: str) -> list[JobProblem]:
    """`[model] base_model` can be had here: an existing directory, a hub id that is cached
    or that the hub confirms within seconds, a GGUF file or a known packaged model (a `tiny:`
    spec is built by the job itself)."""
    if spec.startswith("tiny:"):
        return []
    try:
        check_base_model(spec)
    except (FileNotFoundError, HubUnreachableError, ModelSourceError) as exc:
        return [JobProblem("model", "[model] base_model", str(exc))]
    return []


def _device_problems(info: BackendInfo, kwargs: dict[str, object]) -> list[JobProblem]:
    """`[backend] device` of a built-in backend, checked as its constructor will check it."""
    device = kwargs.get("device")
    if info.source != "builtin" or not isinstance(device, str):
        return []
    option = "[backend] device"
    try:
        if info.name == "ray":
            resources = kwargs.get("resources_per_worker")
            gpus = float(resources.get("GPU", 0)) if isinstance(resources, dict) else 0.0
            resolve_worker_device(device, gpus, option=option)
        elif info.name == "local":
            resolve_device(device, option=option)
    except ValueError as exc:
        return [JobProblem("backend", option, str(exc))]
    return []


def _inference_problems(
    info: BackendInfo, config: JobConfig, factory: Factory, kwargs: dict[str, object]
) -> list[JobProblem]:
    """`[inference]` goes to a backend that takes `inference=` (and, for a built-in one, fits
    its devices), to an engine that can sample the base model, with a sync that can carry
    what it trains. Whether a server takes each step's weights is its answer at register,
    for a job as for the API."""
    inference = config.inference
    problems: list[JobProblem] = []
    params = constructor_parameters(factory)
    if inference != InferenceConfig() and "inference" not in params:
        problems.append(
            JobProblem(
                "backend",
                "[inference]",
                f"backend {config.run.backend!r} ({info.label}) chooses its own sampling: its "
                "constructor takes no inference=, so [inference] would be ignored; remove "
                "[inference], or use backend 'local' or 'ray'",
            )
        )
    if info.source == "builtin" and inference.devices is not None:
        problems += _split_device_problems(info, inference, kwargs.get("device", AUTO))
    problem = engine_model_problem(config)
    if problem is not None:
        problems.append(JobProblem("model", "[inference] engine", problem))
    problem = sync_problem(config)
    if problem is not None:
        problems.append(JobProblem("backend", "[inference] sync", problem))
    return problems


def engine_model_problem(config: JobConfig) -> str | None:
    """Why the job's sampling engine cannot run its base model (`head_problem`), when the
    model's config can be read here without a download; else None (register checks again)."""
    if config.inference.spec.cpu_head_sizes is None:
        return None
    found = base_model_config(config.model.base_model)
    return head_problem(config.inference, found) if found is not None else None


def sync_problem(config: JobConfig) -> str | None:
    """Why register would refuse the job's `[inference] sync = 'lora'` (`lora_sync_problem`,
    as register asks it), when the base model's config can be read here without a download;
    else None (register checks again). Every other sync is the server's to take at register."""
    inference, lora = config.inference, config.model.lora
    if inference.sync != "lora":  # only a server's engine has a sync
        return None
    found = base_model_config(config.model.base_model) if lora is not None else {}
    return lora_sync_problem(planned_layers(lora, found)) if found is not None else None


def base_model_config(spec: str) -> dict[str, object] | None:
    """The base model's transformers config as a dict: built for a `tiny:` spec, read from a
    directory or the local cache otherwise; None when that needs a download or conversion."""
    if spec.startswith("tiny:"):
        from posttrain.jobs.tables import parse_tiny_spec
        from posttrain.models.tiny import build_config

        arch, size, _ = parse_tiny_spec(spec)
        return build_config(arch, size).to_dict()  # pyright: ignore[reportArgumentType]  # checked by the parse
    from transformers import AutoConfig

    from posttrain.models.source import cached_model_source

    try:
        source = cached_model_source(spec)
        return (
            AutoConfig.from_pretrained(source, local_files_only=True).to_dict() if source else None
        )
    except (OSError, ValueError):
        return None


def _split_device_problems(
    info: BackendInfo, inference: InferenceConfig, device: object
) -> list[JobProblem]:
    """`[inference] devices` against the built-in backend, as its constructor will check it."""
    option = "[inference] devices"
    if info.name == "ray":
        message = (
            "RayBackend places its workers with [backend] resources_per_worker; devices is "
            "for backend 'local' (give a Ray job's engine its own resources with engine = "
            "'vllm' or 'openai')"
        )
        return [JobProblem("backend", option, message)]
    if info.name == "local" and isinstance(device, str):
        try:
            trainer_device(device, inference, info.label)
        except ValueError as exc:
            return [JobProblem("backend", option, str(exc))]
    return []


def _needs(info: BackendInfo, config: JobConfig, resume: bool) -> list[JobProblem]:
    """What the job needs of a backend beyond its options."""
    problems: list[JobProblem] = []
    if not info.capabilities.supports_sampling:
        problems.append(
            JobProblem(
                "backend",
                "[run] backend",
                f"{info.label} cannot sample (supports_sampling=false), and the job samples its "
                "rollouts and evaluations through the backend; choose a backend that samples",
            )
        )
    if resume and not info.capabilities.supports_checkpoint_resume:
        problems.append(
            JobProblem(
                "backend",
                "--resume",
                f"{info.label} cannot resume from a checkpoint (supports_checkpoint_resume=false)",
            )
        )
    return problems


def _load_custom_loss(config: JobConfig) -> None:
    """Import a dotted-path `[rl] loss` from beside the config file too, as tasks and rewards
    are. One that fails is preflight's to report: the config's directory stays on sys.path
    (`import_object`), so its retry meets the same error."""
    loss = config.rl.trainer.loss_fn
    if DOTTED_PATH.match(loss):
        with contextlib.suppress(ImportError, ValueError, TypeError):
            custom_loss(loss, search=config.base_dir)


def _preflight(call: Call, check: Callable[[], None]) -> list[JobProblem]:
    try:
        check()
    except PreflightError as exc:
        return [JobProblem(call, p.option, p.message) for p in exc.problems]
    return []


def call_options(values: RLConfig | SFTConfig, schema: Sequence[OptionSchema]) -> dict[str, object]:
    """The job's value of every option the backend declares; preflight refused the rest (any
    set away from its default), so leaving them out changes nothing."""
    declared = {o.name for o in schema}
    # Canonical values: `loss` is the loss the job runs (`ppo = false` is cispo).
    return {key: value for key, value in option_values(values).items() if key in declared}
