"""The `posttrain train` job's TOML configuration, as frozen dataclasses, one per table.

Tables: `[run]`, `[model]`, `[sft]`, `[rl]`, `[eval]`, `[backend]`. `[sft]` and `[rl]` also
accept every option of `backend.train_sft` / `backend.train` (`SFTConfig` / `LocalRLOptions`);
the job passes each backend the options it declares, and preflight refuses the others.
`[run] backend` names the backend: "local", "ray", "tinker", an installed plugin's entry-point
name, or a dotted path "package.module:Factory". `[backend]` holds its constructor's keyword
arguments, checked against the constructor by `jobs.backend` (the job itself supplies `path`
from `[run] output_dir` and `keep_checkpoints` from `[run]`); a value whose key names a secret
(api_key, hf_token, ...) is never written or shown (`redact_secrets`). An unknown table or key
is an error naming the table, the key and the nearest valid key.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

from posttrain.backends.registry import resolve as resolve_backend
from posttrain.engine.tiny import Arch, Size
from posttrain.tasks import get_task
from posttrain.trainer.config import RLConfig, SFTConfig, check_field_types

ARCHES: tuple[str, ...] = get_args(Arch)
SIZES: tuple[str, ...] = get_args(Size)
# A `[backend]` key holds a secret when one of its words (split at `_`, `-`, `.`) is or ends
# with one of these: api_key, apiKey, hf_token, client_secret, password. Not `tokens`, which
# counts tokens (micro_batch_tokens). What is written or shown of it is REDACTED.
SECRET_WORDS = (
    *("key", "keys", "token", "secret", "secrets"),
    *("password", "passwords", "passwd", "credential", "credentials"),
)
REDACTED = "***"


@dataclass(frozen=True)
class RunConfig:
    """What to train on and where the run lives: `<output_dir>/<project>/models/<name>/`."""

    task: str = "reverse"  # a name in posttrain.tasks.TASKS
    name: str = "run"
    project: str = "posttrain"
    output_dir: str = "runs"  # relative to the working directory
    seed: int = 0  # training prompts, sampling, SFT shuffling, model seed
    backend: str = "local"  # a built-in or entry-point name, or "package.module:Factory"
    keep_checkpoints: int = 2  # the job checkpoints every step; keep the last N

    def __post_init__(self) -> None:
        check_field_types(self)
        get_task(self.task)  # raises for an unknown task, naming the choices
        resolve_backend(self.backend)  # raises for an unknown name, listing the known ones
        if self.keep_checkpoints < 1:
            raise ValueError(f"[run] keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclass(frozen=True)
class ModelConfig:
    """The base model: a directory, a hub id, or `tiny:<arch>:<size>[:<init seed>]` built locally."""

    base_model: str = "tiny:qwen2:tiny"
    lora_rank: int = 0  # 0 trains every weight; >= 1 trains LoRA adapters of that rank
    lora_alpha: float | None = None  # None: the LoRA default for the rank
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.lora_rank < 0:
            raise ValueError(
                f"[model] lora_rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}"
            )
        if self.base_model.startswith("tiny:"):
            parse_tiny_spec(self.base_model)


@dataclass(frozen=True)
class SFTWarmupConfig:
    """Optional supervised warm-up before RL: task solutions and/or a JSONL chat dataset."""

    examples: int = 0  # task problems solved by `task.solution`, drawn from the training split
    dataset: str | None = None  # JSONL of {"messages": [...]}, relative to the config file
    trainer: SFTConfig = field(default_factory=SFTConfig)  # the rest of [sft]: train_sft options

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.examples < 0:
            raise ValueError(f"[sft] examples must be >= 0, got {self.examples}")
        if not self.trainer.save_checkpoint:
            raise ValueError("[sft] save_checkpoint must be true: resuming needs the checkpoint")

    @property
    def enabled(self) -> bool:
        return self.examples > 0 or self.dataset is not None


@dataclass(frozen=True)
class RLJobConfig:
    """RL steps: `prompts_per_step` prompts x `group_size` samples, one `backend.train` each."""

    steps: int = 50
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    lr_warmup_steps: int = 0  # linear warm-up of learning_rate over the first steps
    trainer: RLConfig = field(default_factory=RLConfig)  # the rest of [rl]: train options

    def __post_init__(self) -> None:
        check_field_types(self)
        for key in ("steps", "lr_warmup_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"[rl] {key} must be >= 0, got {getattr(self, key)}")
        for key in ("prompts_per_step", "max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"[rl] {key} must be >= 1, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ValueError(
                f"[rl] group_size must be >= 2 (advantages compare within a group), got {self.group_size}"
            )
        if not self.temperature > 0:
            raise ValueError(f"[rl] temperature must be > 0 to explore, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"[rl] top_p must be in (0, 1], got {self.top_p}")
        if not self.trainer.save_checkpoint:
            raise ValueError(
                "[rl] save_checkpoint must be true: resuming needs a checkpoint per step"
            )


@dataclass(frozen=True)
class EvalConfig:
    """Greedy accuracy on a fixed held-out set, before RL, every `every` steps, and after."""

    held_out: int = 200  # problems in the held-out set
    seed: int = 0  # which held-out problems; independent of [run] seed, so runs compare
    every: int = 0  # also evaluate every N RL steps (0: before and after only)
    max_tokens: int | None = None  # None: [rl] max_tokens

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.held_out < 1:
            raise ValueError(f"[eval] held_out must be >= 1, got {self.held_out}")
        if self.every < 0:
            raise ValueError(f"[eval] every must be >= 0, got {self.every}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"[eval] max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class JobConfig:
    """A whole `posttrain train` job; `source` is the TOML file it came from, if any."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTWarmupConfig = field(default_factory=SFTWarmupConfig)
    rl: RLJobConfig = field(default_factory=RLJobConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backend: Mapping[str, object] = field(default_factory=dict[str, object])  # [backend] kwargs
    source: Path | None = field(default=None, compare=False)

    def dataset_path(self) -> Path | None:
        """`[sft] dataset`, resolved against the config file's directory."""
        if self.sft.dataset is None:
            return None
        base = self.source.parent if self.source is not None else Path.cwd()
        return base / self.sft.dataset


def is_secret(key: str) -> bool:
    """Whether a `[backend]` key names a secret (see SECRET_WORDS)."""
    words = re.split(r"[^a-z0-9]+", key.lower())
    return any(word.endswith(SECRET_WORDS) for word in words)


def redact_secrets(table: Mapping[str, object]) -> dict[str, object]:
    """`table` as it may be written or shown: each secret's value is REDACTED, its key kept so
    one can see it was set."""
    return {key: REDACTED if is_secret(key) else value for key, value in table.items()}


def parse_tiny_spec(spec: str) -> tuple[str, str, int | None]:
    """`tiny:<arch>:<size>[:<seed>]` -> (arch, size, seed or None)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[1] not in ARCHES or parts[2] not in SIZES:
        raise ValueError(
            f"[model] base_model={spec!r}: a local tiny model is 'tiny:<arch>:<size>[:<seed>]' "
            f"with arch in {list(ARCHES)} and size in {sorted(SIZES)}, e.g. 'tiny:qwen2:tiny'"
        )
    if len(parts) == 4 and not parts[3].isdigit():
        raise ValueError(f"[model] base_model={spec!r}: the seed after the size must be an integer")
    return parts[1], parts[2], int(parts[3]) if len(parts) == 4 else None


def load_config(path: str | Path) -> JobConfig:
    """Read a TOML job file; errors name the table and key at fault."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    return parse_config(data, source=path)


def parse_config(data: Mapping[str, object], *, source: Path | None = None) -> JobConfig:
    """Build a JobConfig from parsed TOML."""
    tables = {
        "run": RunConfig,
        "model": ModelConfig,
        "sft": SFTWarmupConfig,
        "rl": RLJobConfig,
        "eval": EvalConfig,
    }
    names = [*tables, "backend"]
    for name, value in data.items():
        if name not in names:
            raise ValueError(
                f"unknown table [{name}]{_hint(name, names)} (tables: {', '.join(names)})"
            )
        if not isinstance(value, dict):
            raise ValueError(f"[{name}] must be a table, got {value!r}")
    built = {name: _build(cls, dict(data.get(name) or {}), name) for name, cls in tables.items()}  # type: ignore[call-overload]
    backend = dict(data.get("backend") or {})  # type: ignore[call-overload]
    for key, value in backend.items():
        if isinstance(value, dict):
            raise ValueError(f"[backend] {key} must be a value, got a table")
    return JobConfig(**built, backend=backend, source=source)  # type: ignore[arg-type]


def _build(cls: type, table: dict[str, object], name: str) -> object:
    """`cls(**table)`; keys that are not `cls`'s own go to its `trainer` options, if it has one."""
    own = {f.name for f in fields(cls)} - {"trainer"}
    trainer = next((f for f in fields(cls) if f.name == "trainer"), None)
    trainer_cls = {"sft": SFTConfig, "rl": RLConfig}.get(name) if trainer else None
    passthrough = {f.name for f in fields(trainer_cls)} if trainer_cls else set[str]()
    for key, value in table.items():
        if key not in own and key not in passthrough:
            raise ValueError(f"[{name}] unknown key {key!r}{_hint(key, own | passthrough)}")
        if isinstance(value, dict):
            raise ValueError(f"[{name}] {key} must be a value, got a table")
    kwargs = {k: v for k, v in table.items() if k in own}
    try:
        if trainer_cls is not None:
            kwargs["trainer"] = trainer_cls(**{k: v for k, v in table.items() if k in passthrough})
        return cls(**kwargs)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("[") else f"[{name}] {message}") from None


def _hint(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
