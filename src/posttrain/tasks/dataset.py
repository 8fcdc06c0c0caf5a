"""Dataset tasks: problems read from data files, scored by a named reward. No code needed.

A data file is JSONL, JSON, CSV, Parquet, Arrow, a `datasets.save_to_disk` directory
(`DIR@SPLIT` for a DatasetDict) or a hub id `hf:NAME[:CONFIG][@SPLIT]`: see
`posttrain.data.rows`, which reads them all. Each row (a JSONL line) is an object. Its prompt is
a string field (`prompt_field`, "prompt" unless named) or a chat, a list of {"role", "content"}
messages (`messages_field`) ending with a user or tool turn. Its answer is the field
`answer_field` ("answer"): a string or a number. Every built-in reward needs the answer; a
custom reward gets `problem.answer = None` on a row without one, and the whole row in
`problem.info`. `system_prompt` is put before each prompt.

The held-out split: with a `held_out` file, training uses the `train` file less any row whose
prompt is also in the held-out file. With one file, a row is held out when its prompt's hash
falls in the first `held_out_fraction` of the hash range: blake2b (8 bytes, big-endian) of the
prompt string (or of the messages list as compact, key-sorted JSON) divided by 2**64 is below
the fraction. The rule depends on nothing but the prompt, so held-out and training are
disjoint (equal prompts land on the same side) and stay so whatever the seeds and sizes.

Every row is checked when the task is built, so a bad row fails before any training; the task
then keeps only each split's row numbers, and builds a problem when a step draws it (a
Parquet file of millions of rows stays in its memory-mapped Arrow table).
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, overload

from posttrain.data.rows import HUB_PREFIX, Rows, open_rows, parse_hub_id
from posttrain.tasks.protocol import Problem
from posttrain.tasks.rewards import (
    BUILTIN_REWARDS,
    GroupRewardFn,
    RewardFn,
    RewardSource,
    make_reward,
    number_value,
)
from posttrain.types import StopReason

DEFAULT_HELD_OUT_FRACTION = 0.1
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Fields:
    """Which fields of a row hold the prompt (a string, or chat messages) and the answer."""

    prompt: str | None = None
    messages: str | None = None
    answer: str = "answer"

    def __post_init__(self) -> None:
        if self.prompt is not None and self.messages is not None:
            raise ValueError(
                f"prompt_field ({self.prompt!r}) and messages_field ({self.messages!r}) are both "
                "set: a prompt is a string or a chat, name one of them"
            )

    @property
    def prompt_key(self) -> str:
        return self.messages or self.prompt or "prompt"


def held_out_by_hash(key: str, fraction: float) -> bool:
    """Whether a prompt (see `split_key`) is in the held-out `fraction` of the hash range."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def split_key(prompt: str | list[dict[str, str]]) -> str:
    """What the split hashes: the prompt string, or the messages as compact sorted JSON."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _problem(
    record: dict[str, Any],
    fields: Fields,
    system_prompt: str | None,
    needs_answer: bool,
    source: str,
    unit: str = "line",
) -> tuple[str, Problem]:
    key = fields.prompt_key
    option = "messages_field" if fields.messages else "prompt_field"
    if key not in record:
        raise ValueError(f"no field {key!r} ({option}); the {unit} has {_keys(record)}")
    value = record[key]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if fields.messages:
        messages = _check_chat(value, key)
        prompt = next(m["content"] for m in reversed(messages) if m["role"] != "system")
        if messages[0]["role"] == "system":
            system = []  # the row's own system prompt wins
    else:
        if not isinstance(value, str):
            raise ValueError(f"field {key!r} (prompt_field) must be a string, got {value!r}")
        messages, prompt = [{"role": "user", "content": value}], value
    answer = _answer(record, fields.answer, needs_answer, unit)
    problem = Problem(
        prompt=prompt,
        answer=answer,
        messages=tuple([*system, *messages]) if (system or fields.messages) else (),
        source=source,
        info=record,
    )
    return split_key(value), problem


def _answer(record: dict[str, object], field: str, needed: bool, unit: str) -> str | None:
    if field not in record:
        if needed:
            raise ValueError(
                f"no field {field!r} (answer_field), which the reward compares with; the {unit} "
                f"has {_keys(record)}"
            )
        return None
    value = record[field]
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"field {field!r} (answer_field) must be a string or a number, got {value!r}")


def _check_chat(value: object, key: str) -> list[dict[str, str]]:
    """A non-empty list of {"role", "content"} strings whose last turn is the user's (or a tool's)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {key!r} (messages_field) must be a non-empty list of messages")
    messages: list[dict[str, str]] = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"field {key!r} (messages_field): message {i} must be {{'role': one of "
                f"{list(ROLES)}, 'content': a string}}, got {message!r}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if messages[-1]["role"] in ("assistant", "system"):
        raise ValueError(
            f"field {key!r} (messages_field) ends with role {messages[-1]['role']!r}; the model "
            "answers the chat, so it must end with a user (or tool) message (an answer goes in "
            "the answer field)"
        )
    return messages


def _keys(record: dict[str, object]) -> str:
    return ", ".join(map(repr, record)) if record else "no fields"


@dataclass(frozen=True)
class Reading:
    """How a row becomes a problem: the fields, the system prompt, whether it needs an answer,
    and whether that answer must be a number (the `number` reward)."""

    fields: Fields
    system_prompt: str | None
    needs_answer: bool
    numeric: bool = False

    def problem(self, rows: Rows, index: int, record: dict[str, Any]) -> tuple[str, Problem]:
        """(split key, problem) of row `index`; a ValueError names the row and the field."""
        where = rows.where(index)
        try:
            key, problem = _problem(
                record, self.fields, self.system_prompt, self.needs_answer, where, rows.unit
            )
            if self.numeric:
                try:
                    number_value(problem.reference())
                except ValueError as exc:
                    raise ValueError(f"field {self.fields.answer!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return key, problem

    def scan(self, rows: Rows) -> Iterator[tuple[int, str]]:
        """(index, split key) of every row, each checked, none kept: one pass, streamed."""
        for index, record in rows.records():
            yield index, self.problem(rows, index, record)[0]


class ProblemRows(Sequence[Problem]):
    """The problems of some rows of a source, built when asked for: only row numbers are kept."""

    def __init__(self, rows: Rows, indices: array[int], reading: Reading) -> None:
        self.rows, self.indices, self.reading = rows, indices, reading

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, index: int) -> Problem: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Problem]: ...
    def __getitem__(self, index: int | slice) -> Problem | Sequence[Problem]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self.indices[index]  # an IndexError past the end, which ends iteration
        return self.reading.problem(self.rows, row, self.rows[row])[1]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ProblemRows | tuple | list):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = object.__hash__


@dataclass(frozen=True)
class DatasetTask:
    """A task made of a data file's problems and a reward; see the module docstring.

    Build one with `DatasetTask.from_file(...)` (`from_jsonl` is the same). Each RL step draws
    distinct training problems (all of them, in a new order, when it asks for more than there
    are); `held_out(seed, n)` is the first n of a seeded shuffle of the held-out problems (all
    of them when n exceeds it).
    """

    name: str
    train: Sequence[Problem]
    held_out_problems: Sequence[Problem]
    reward_fn: RewardFn
    reward_spec: str  # how errors and records name the reward: "exact", "pkg.mod:fn", ...
    dropped_from_train: int = 0  # training rows left out because the held-out file has them
    # The rows each split came from ("train", "held_out"): a resumed job compares their digests.
    sources: Mapping[str, Rows] = field(default_factory=dict[str, Rows], compare=False)
    reward_source: RewardSource | None = None  # a Judge or RewardModel given as the reward

    @property
    def group_reward(self) -> GroupRewardFn | None:
        """The reward source's group reward (a group judge, a reward model), else None."""
        return self.reward_source.group_reward if self.reward_source is not None else None

    @classmethod
    def from_file(
        cls,
        train: str | Path,
        held_out: str | Path | None = None,
        *,
        held_out_fraction: float | None = None,
        prompt_field: str | None = None,
        messages_field: str | None = None,
        answer_field: str = "answer",
        system_prompt: str | None = None,
        reward: str | RewardFn | RewardSource = "exact",
        tolerance: float | None = None,
        pattern: str | None = None,
        name: str | None = None,
        search: Path | None = None,
    ) -> DatasetTask:
        """Read and check every row now (a bad row is an error before any training).

        `train` and `held_out` are any source `posttrain.data.rows.open_rows` reads: a file,
        a `datasets.save_to_disk` directory (`DIR@SPLIT`), or `hf:NAME[:CONFIG][@SPLIT]`.
        `reward` is a built-in name, a dotted path (imported from `sys.path`, then `search`),
        the function itself, or a reward object (`Judge`, `RewardModel`).
        """
        fields = Fields(prompt_field, messages_field, answer_field)
        source = None
        if isinstance(reward, str):
            reward_fn = make_reward(reward, tolerance=tolerance, pattern=pattern, search=search)
            spec = reward
        elif isinstance(getattr(reward, "spec", None), str) and hasattr(reward, "group_reward"):
            source = cast(RewardSource, reward)
            reward_fn, spec = source.reward, source.spec
        else:
            function = cast(RewardFn, reward)
            reward_fn, spec = function, f"{function.__module__}:{function.__qualname__}"
        reading = Reading(fields, system_prompt, spec in BUILTIN_REWARDS, spec == "number")
        if held_out is not None and held_out_fraction is not None:
            raise ValueError(
                "held_out_fraction splits the train file when there is no held_out file; "
                "give one or the other"
            )
        fraction = DEFAULT_HELD_OUT_FRACTION if held_out_fraction is None else held_out_fraction
        if held_out is None and not 0 < fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {fraction}")
        rows = _nonempty(open_rows(train))
        kept, held = array("q"), array("q")
        sources = {"train": rows}
        if held_out is not None:
            for _ in reading.scan(rows):  # the train file's errors first, as it is named first
                pass
            tests = _nonempty(open_rows(held_out))
            keys = {key for _, key in reading.scan(tests)}
            # A second pass: keeping the first pass's keys would hold every prompt in memory.
            for index, key in reading.scan(rows):
                if key not in keys:
                    kept.append(index)
            held_problems = ProblemRows(tests, array("q", range(len(tests))), reading)
            sources["held_out"] = tests
        else:
            for index, key in reading.scan(rows):
                (held if held_out_by_hash(key, fraction) else kept).append(index)
            held_problems = ProblemRows(rows, held, reading)
        _check_split(rows, held_out, len(kept), len(held_problems))
        return cls(
            name=name or _name(train),
            train=ProblemRows(rows, kept, reading),
            held_out_problems=held_problems,
            reward_fn=reward_fn,
            reward_spec=spec,
            dropped_from_train=len(rows) - len(kept) if held_out is not None else 0,
            sources=sources,
            reward_source=source,
        )

    from_jsonl = from_file  # its name from when JSONL was the only format

    def make_prompts(self, rng: random.Random, n: int) -> list[Problem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        picks: list[Problem] = []
        while len(picks) < n:
            picks += rng.sample(self.train, min(len(self.train), n - len(picks)))
        return picks

    def held_out(self, seed: int, n: int) -> list[Problem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        # Shuffled as positions: a shuffle's swaps depend on the length alone, so this is the
        # order a shuffle of the problems themselves gives, without building them all.
        order = list(range(len(self.held_out_problems)))
        random.Random(f"held-out:{seed}").shuffle(order)
        return [self.held_out_problems[i] for i in order[:n]]

    def reward(
        self, problem: Problem, completion: str, stop_reason: StopReason
    ) -> float | Awaitable[float]:
        return self.reward_fn(problem, completion, stop_reason)

    def solution(self, problem: Problem) -> str:
        return problem.reference()


def _nonempty(rows: Rows) -> Rows:
    if not len(rows):
        raise ValueError(f"data file {rows.source!r} has no {rows.unit}s")
    return rows


def _name(train: str | Path) -> str:
    """A task's default name: the file's stem, or a hub dataset's own name."""
    if str(train).startswith(HUB_PREFIX):
        return parse_hub_id(str(train))[0].rpartition("/")[2]
    return Path(train).stem


def _check_split(rows: Rows, held_out: str | Path | None, kept: int, held: int) -> None:
    if not kept:
        why = (
            f"every {rows.unit} is also in the held_out file {str(held_out)!r}"
            if held_out is not None
            else f"the split held out all of its {rows.unit}s; lower held_out_fraction"
        )
        raise ValueError(f"data file {rows.source!r} leaves no training problems: {why}")
    if not held:
        raise ValueError(
            f"data file {rows.source!r}: the split put none of its {len(rows)} {rows.unit}s in "
            "the held-out set; raise held_out_fraction, add rows, or give a held_out file"
        )
