"""Dataset tasks: problems read from JSONL files, scored by a named reward. No code needed.

Each line of a file is a JSON object. Its prompt is a string field (`prompt_field`, "prompt"
unless named) or a chat, a list of {"role", "content"} messages (`messages_field`) ending with
a user or tool turn. Its answer is the field `answer_field` ("answer"): a string or a number.
Every built-in reward needs the answer; a custom reward gets `problem.answer = None` on a line
without one, and the whole line in `problem.info`. `system_prompt` is put before each prompt.

The held-out split: with a `held_out` file, training uses the `train` file less any line whose
prompt is also in the held-out file. With one file, a line is held out when its prompt's hash
falls in the first `held_out_fraction` of the hash range: blake2b (8 bytes, big-endian) of the
prompt string (or of the messages list as compact, key-sorted JSON) divided by 2**64 is below
the fraction. The rule depends on nothing but the prompt, so held-out and training are
disjoint (equal prompts land on the same side) and stay so whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

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
    """Which JSONL fields hold the prompt (a string, or chat messages) and the answer."""

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


def read_problems(
    path: Path, fields: Fields, *, system_prompt: str | None = None, needs_answer: bool = True
) -> list[tuple[str, Problem]]:
    """(split key, problem) of each non-blank line; errors name the file, line and field."""
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    problems: list[tuple[str, Problem]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            problems.append(_problem(line, fields, system_prompt, needs_answer, f"{path}:{number}"))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError too
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not problems:
        raise ValueError(f"data file {str(path)!r} has no lines")
    return problems


def json_object(line: str) -> dict[str, Any]:
    """One JSONL line's object, or a ValueError saying what the line is instead."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"each line must be a JSON object, got {type(record).__name__}")
    return record


def _problem(
    line: str, fields: Fields, system_prompt: str | None, needs_answer: bool, source: str
) -> tuple[str, Problem]:
    record = json_object(line)
    key = fields.prompt_key
    option = "messages_field" if fields.messages else "prompt_field"
    if key not in record:
        raise ValueError(f"no field {key!r} ({option}); the line has {_keys(record)}")
    value = record[key]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if fields.messages:
        messages = _check_chat(value, key)
        prompt = next(m["content"] for m in reversed(messages) if m["role"] != "system")
        if messages[0]["role"] == "system":
            system = []  # the line's own system prompt wins
    else:
        if not isinstance(value, str):
            raise ValueError(f"field {key!r} (prompt_field) must be a string, got {value!r}")
        messages, prompt = [{"role": "user", "content": value}], value
    answer = _answer(record, fields.answer, needs_answer)
    problem = Problem(
        prompt=prompt,
        answer=answer,
        messages=tuple([*system, *messages]) if (system or fields.messages) else (),
        source=source,
        info=record,
    )
    return split_key(value), problem


def _answer(record: dict[str, object], field: str, needed: bool) -> str | None:
    if field not in record:
        if needed:
            raise ValueError(
                f"no field {field!r} (answer_field), which the reward compares with; the line "
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
class DatasetTask:
    """A task made of JSONL problems and a reward; see the module docstring for the files.

    Build one with `DatasetTask.from_jsonl(...)`. Each RL step draws distinct training problems
    (all of them, in a new order, when it asks for more than there are); `held_out(seed, n)` is
    the first n of a seeded shuffle of the held-out problems (all of them when n exceeds it).
    """

    name: str
    train: tuple[Problem, ...]
    held_out_problems: tuple[Problem, ...]
    reward_fn: RewardFn
    reward_spec: str  # how errors and records name the reward: "exact", "pkg.mod:fn", ...
    dropped_from_train: int = 0  # training lines left out because the held-out file has them
    reward_source: RewardSource | None = None  # a Judge or RewardModel given as the reward

    @property
    def group_reward(self) -> GroupRewardFn | None:
        """The reward source's group reward (a group judge, a reward model), else None."""
        return self.reward_source.group_reward if self.reward_source is not None else None

    @classmethod
    def from_jsonl(
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
        """Read the files (all of it, now: a bad line is an error before any training).

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
        needs_answer = spec in BUILTIN_REWARDS
        read = {"system_prompt": system_prompt, "needs_answer": needs_answer}
        lines = read_problems(Path(train), fields, **read)
        if held_out is not None:
            if held_out_fraction is not None:
                raise ValueError(
                    "held_out_fraction splits the train file when there is no held_out file; "
                    "give one or the other"
                )
            tests = read_problems(Path(held_out), fields, **read)
            keys = {key for key, _ in tests}
            kept = [p for key, p in lines if key not in keys]
            held = [p for _, p in tests]
        else:
            fraction = DEFAULT_HELD_OUT_FRACTION if held_out_fraction is None else held_out_fraction
            if not 0 < fraction < 1:
                raise ValueError(f"held_out_fraction must be in (0, 1), got {fraction}")
            kept = [p for key, p in lines if not held_out_by_hash(key, fraction)]
            held = [p for key, p in lines if held_out_by_hash(key, fraction)]
        _check_split(Path(train), held_out, len(lines), kept, held)
        if spec == "number":
            for problem in [*kept, *held]:
                try:
                    number_value(problem.reference())
                except ValueError as exc:
                    raise ValueError(f"{problem.source}: field {answer_field!r}: {exc}") from None
        return cls(
            name=name or Path(train).stem,
            train=tuple(kept),
            held_out_problems=tuple(held),
            reward_fn=reward_fn,
            reward_spec=spec,
            dropped_from_train=len(lines) - len(kept) if held_out is not None else 0,
            reward_source=source,
        )

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
        order = list(self.held_out_problems)
        random.Random(f"held-out:{seed}").shuffle(order)
        return order[:n]

    def reward(
        self, problem: Problem, completion: str, stop_reason: StopReason
    ) -> float | Awaitable[float]:
        return self.reward_fn(problem, completion, stop_reason)

    def solution(self, problem: Problem) -> str:
        return problem.reference()


def _check_split(
    train: Path,
    held_out: str | Path | None,
    lines: int,
    kept: Sequence[Problem],
    held: Sequence[Problem],
) -> None:
    if not kept:
        why = (
            f"every line is also in the held_out file {str(held_out)!r}"
            if held_out is not None
            else "the split held out all of its lines; lower held_out_fraction"
        )
        raise ValueError(f"data file {str(train)!r} leaves no training problems: {why}")
    if not held:
        raise ValueError(
            f"data file {str(train)!r}: the split put none of its {lines} lines in the held-out "
            "set; raise held_out_fraction, add lines, or give a held_out file"
        )
