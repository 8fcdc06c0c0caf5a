"""Job tables as values: a table's dataclass built from TOML (its unknown keys named, with the
closest valid one), the secrets a table must not show, the tiny-model spec, the tables `[sft]`,
`[dpo]`, `[teacher]`, `[eval]` and `[data]`, and the checks of `[judge]` and `[reward_model]`
(the others are in `jobs.config`)."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, TypeVar, get_args

from posttrain.algo.config_fields import option
from posttrain.finder import did_you_mean
from posttrain.models.tiny import Arch, Size, resolve_arch
from posttrain.tasks.judge import JudgeConfig
from posttrain.tasks.reward_model import RewardModelConfig
from posttrain.tasks.rewards import BUILTIN_REWARDS, JUDGE, MODEL_PREFIX

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from posttrain.trainer.config import (
    DPOConfig,
    RLConfig,
    SFTConfig,
    check_field_types,
    from_options,
    option_fields,
)

T = TypeVar("T", bound="DataclassInstance")
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


def is_secret(key: str) -> bool:
    """Whether a `[backend]` key names a secret (see SECRET_WORDS)."""
    words = re.split(r"[^a-z0-9]+", key.lower())
    return any(word.endswith(SECRET_WORDS) for word in words)


def redact_secrets(table: Mapping[str, object]) -> dict[str, object]:
    """`table` as it may be written or shown: each secret's value is REDACTED, its key kept so
    one can see it was set (None, not set, stays None)."""
    return {
        key: REDACTED if is_secret(key) and value is not None else value
        for key, value in table.items()
    }


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
    try:
        resolve_arch(parts[1], parts[2])  # pyright: ignore[reportArgumentType]  # both checked just above
    except ValueError as exc:  # a real size with another architecture
        raise ValueError(f"[model] base_model={spec!r}: {exc}") from None
    return parts[1], parts[2], int(parts[3]) if len(parts) == 4 else None


def build_table(cls: type[T], table: Mapping[str, object], name: str) -> T:
    """`cls(**table)`; keys that are not `cls`'s own go to its `trainer` options, if it has one
    (the flat `train()` / `train_sft()` keys, built into the nested config by `from_options`)."""
    own = {f.name for f in fields(cls)} - {"trainer"}
    trainer = next((f for f in fields(cls) if f.name == "trainer"), None)
    trainer_cls = (
        {"sft": SFTConfig, "dpo": DPOConfig, "rl": RLConfig}.get(name) if trainer else None
    )
    passthrough = set(option_fields(trainer_cls)) if trainer_cls else set[str]()
    for key, value in table.items():
        if key not in own and key not in passthrough:
            raise ValueError(f"[{name}] unknown key {key!r}{did_you_mean(key, own | passthrough)}")
        if isinstance(value, dict):
            raise ValueError(f"[{name}] {key} must be a value, got a table")
    kwargs = {k: v for k, v in table.items() if k in own}
    try:
        if trainer_cls is not None:
            options = {k: v for k, v in table.items() if k in passthrough}
            kwargs["trainer"] = from_options(trainer_cls, options)
        construct: Callable[..., T] = cls
        return construct(**kwargs)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("[") else f"[{name}] {message}") from None


@dataclass(frozen=True)
class SFTWarmupConfig:
    """Optional supervised warm-up before RL: task solutions and/or a chat dataset."""

    examples: int = option(
        0, "task problems solved by the task's solution, drawn from the training split"
    )
    dataset: str | None = option(
        None, 'rows of {"messages": [...]} (or prompt, answer), in any format [data] train takes'
    )
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
class DPOJobConfig:
    """One `train_dpo` call after the warm-up, on a data file of preference pairs
    (`jobs.dpo_data`: prompt or messages, chosen, rejected)."""

    data: str = option("", "preference pairs, in any format [data] train takes")
    trainer: DPOConfig = field(default_factory=DPOConfig)  # the rest of [dpo]: train_dpo options
    # The train_dpo options the table sets: each reaches train_dpo, or preflight refuses it,
    # even at its default (TinkerBackend's reference is 'initial' whatever the default says).
    written: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.data:
            raise ValueError('[dpo] needs data, a JSONL file of pairs, e.g. data = "pairs.jsonl"')
        if not self.trainer.save_checkpoint:
            raise ValueError("[dpo] save_checkpoint must be true: resuming needs the checkpoint")


@dataclass(frozen=True)
class TeacherConfig:
    """`[teacher]`: on-policy distillation's teacher (docs/distillation.md), which scores the
    student's sampled tokens in every RL step; `[rl] distill_reward_coef` mixes the task reward
    back in. Either `model`, loaded in this process, or `url`, a server the tinker SDK reads."""

    # A base model (directory, hub id, tiny:..., packaged:...) or a checkpoint of a posttrain
    # run (<run>/checkpoints/<step>: its base model and LoRA settings are read from it).
    model: str | None = option(
        None, "a base model or a posttrain run's checkpoint, loaded in this process"
    )
    url: str | None = option(
        None, "or a posttrain serve or the Tinker service, e.g. http://host:8000"
    )
    model_path: str | None = option(None, "with url: a saved sampler checkpoint, tinker://...")
    base_model: str | None = option(
        None, "with url: the server's base model (instead of model_path)"
    )
    api_key: str | None = option(None, "with url: the API key (None: $TINKER_API_KEY)")
    tokenizer: str | None = option(
        None, "with url: the tokenizer (a directory or hub id) instead of the SDK's"
    )
    name: str | None = option(None, "the teacher in messages (None: its model)")

    def __post_init__(self) -> None:
        check_field_types(self)
        if (self.model is None) == (self.url is None):
            raise ValueError(
                "[teacher] needs model (loaded here: a model or a run's checkpoint) or url (a "
                "posttrain serve or Tinker service), not both"
            )
        remote = ("model_path", "base_model", "api_key", "tokenizer")
        if self.model is not None:
            for key in remote:
                if getattr(self, key) is not None:
                    raise ValueError(f"[teacher] {key} goes with url, not with model")
        elif (self.model_path is None) == (self.base_model is None):
            raise ValueError(
                "[teacher] url needs model_path (a sampler checkpoint, tinker://...) or "
                "base_model (the server's base model), one of them"
            )


@dataclass(frozen=True)
class EvalConfig:
    """Greedy accuracy on a fixed held-out set, before RL, every `every` steps, and after."""

    held_out: int = option(200, "problems in the held-out set")
    seed: int = option(0, "which held-out problems (independent of [run] seed: runs compare)")
    every: int = option(0, "also evaluate every N RL steps (0: before and after only)")
    max_tokens: int | None = option(None, "tokens per evaluation completion (None: [rl]'s)")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.held_out < 1:
            raise ValueError(f"[eval] held_out must be >= 1, got {self.held_out}")
        if self.every < 0:
            raise ValueError(f"[eval] every must be >= 0, got {self.every}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"[eval] max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class DataConfig:
    """A dataset task: data files (relative to the config file) or hub ids and a reward; see
    `posttrain.tasks.dataset` for the row format and the held-out split rule, and
    `posttrain.data.rows` for the formats."""

    train: str = option(
        "",
        "training problems (required): a .jsonl, .json, .csv, .parquet or .arrow file or a "
        "datasets.save_to_disk directory (DIR@SPLIT for a DatasetDict), relative to the config "
        "file, or hf:NAME[:CONFIG][@SPLIT]; all but JSONL and JSON need pip install "
        "'posttrain[data]'",
    )
    held_out: str | None = option(
        None, "held-out problems, in any format train takes (None: split off train)"
    )
    held_out_fraction: float | None = option(
        None, "with no held_out file: the fraction split off train (0.1 unless set)"
    )
    prompt_field: str | None = option(
        None, 'the prompt\'s string field ("prompt" unless messages_field is set)'
    )
    messages_field: str | None = option(None, 'or a chat field: a list of {"role", "content"}')
    answer_field: str = option("answer", "the field holding the reference answer")
    system_prompt: str | None = option(None, "a system prompt put before each problem")
    reward: str = option(
        "exact",
        'exact, contains, number, regex, math, "pkg.module:function", "judge" (the [judge] '
        'table\'s LLM judge) or "model:PATH" (a reward model directory)',
    )
    tolerance: float | None = option(None, 'reward "number": absolute tolerance (default 1e-6)')
    pattern: str | None = option(None, 'reward "regex": the pattern that extracts the answer')

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.train:
            raise ValueError("[data] train is required: the data file of training problems")
        known = (*BUILTIN_REWARDS, JUDGE)
        if ":" not in self.reward and self.reward not in known:
            raise ValueError(
                f"[data] reward {self.reward!r} is unknown{did_you_mean(self.reward, known)} "
                f"(built-in: {', '.join(BUILTIN_REWARDS)}; or a function 'pkg.module:function', "
                "'judge', 'model:PATH')"
            )
        if self.reward == MODEL_PREFIX:
            raise ValueError("[data] reward 'model:' needs the reward model's directory after it")


def reward_tables(
    data: Mapping[str, object], dataset: DataConfig | None
) -> tuple[JudgeConfig | None, RewardModelConfig | None]:
    """`[judge]` goes with `[data] reward = "judge"` (which needs it), `[reward_model]` with
    `reward = "model:PATH"` (optional: its defaults)."""
    reward = dataset.reward if dataset is not None else None
    if reward == JUDGE and "judge" not in data:
        raise ValueError(
            '[data] reward = "judge" needs a [judge] table: base_url, model and rubric at least'
        )
    if "judge" in data and reward != JUDGE:
        raise ValueError(
            '[judge] configures the judge of [data] reward = "judge"; set it or remove [judge]'
        )
    if "reward_model" in data and not (reward or "").startswith(MODEL_PREFIX):
        raise ValueError(
            '[reward_model] configures [data] reward = "model:PATH"; set it or remove [reward_model]'
        )
    judge = build_table(JudgeConfig, table_of(data, "judge"), "judge") if "judge" in data else None
    reward_model = None
    if (reward or "").startswith(MODEL_PREFIX):
        reward_model = build_table(
            RewardModelConfig, table_of(data, "reward_model"), "reward_model"
        )
    return judge, reward_model


def table_of(data: Mapping[str, object], name: str) -> dict[str, object]:
    """The table `[name]` (checked to be one by `parse_config`), or {} when absent."""
    table = data.get(name) or {}
    if not isinstance(table, dict):
        raise ValueError(f"[{name}] must be a table, got {table!r}")
    return {str(key): value for key, value in table.items()}


def toml_with_overrides(text: str, overrides: Sequence[str]) -> str:
    """A job file's TOML `text` with each `TABLE.KEY=VALUE` of `overrides` written in: the key's
    line replaced where the table has it, else added at the end of the table (or in a new table
    at the end), the file's comments kept. Parsed, it equals `with_overrides` of the file."""
    lines = text.splitlines()
    for item in overrides:
        table, key, value, as_toml = _split_set(item)
        # A value given bare is a string: as JSON writes it, a TOML basic string.
        line = f"{key} = {item.partition('=')[2].strip() if as_toml else json.dumps(value)}"
        header = next((i for i, s in enumerate(lines) if s.strip() == f"[{table}]"), None)
        if header is None:
            lines += ["", f"[{table}]", line]
            continue
        end = next(
            (i for i in range(header + 1, len(lines)) if lines[i].lstrip().startswith("[")),
            len(lines),
        )
        at = next((i for i in range(header + 1, end) if _key_of(lines[i]) == key), None)
        if at is not None:
            lines[at] = line
            continue
        while end > header + 1 and not lines[end - 1].strip():
            end -= 1  # after the table's last key, before the blank lines that end it
        lines.insert(end, line)
    return "\n".join(lines) + "\n"


def _key_of(line: str) -> str | None:
    name, equals, _ = line.partition("=")
    name = name.strip()
    return name if equals and name and not name.startswith("#") else None


def _split_set(item: str) -> tuple[str, str, object, bool]:
    """(table, key, value, whether VALUE was read as TOML) of one `TABLE.KEY=VALUE`."""
    name, equals, text = item.partition("=")
    table, dot, key = name.strip().partition(".")
    if not (equals and dot and table and key):
        raise ValueError(f"--set {item!r}: write TABLE.KEY=VALUE, e.g. --set rl.steps=2")
    try:
        return table, key, tomllib.loads(f"value = {text}")["value"], True
    except tomllib.TOMLDecodeError:
        return table, key, text.strip(), False


def with_overrides(data: Mapping[str, object], overrides: Sequence[str]) -> dict[str, object]:
    """`data` (parsed TOML) with each `TABLE.KEY=VALUE` of `overrides` set, as the command
    line's `--set` gives them. VALUE is read as a TOML value (`2`, `1e-3`, `true`, `"a b"`),
    else taken as a string (`--set run.name=short`); the keys are checked as the file's are."""
    out = {name: dict(table) if isinstance(table, dict) else table for name, table in data.items()}
    for item in overrides:
        table, key, value, _ = _split_set(item)
        section = out.setdefault(table, {})
        if not isinstance(section, dict):
            raise ValueError(f"--set {item!r}: [{table}] is not a table")
        section[key] = value
    return out
