"""What an LLM judge is asked, and how its answers are read (`posttrain.tasks.judge` has the
rules in words): the prompts of each mode and the strict parsers of their answers."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

Prompt = str | Sequence[Mapping[str, str]]
# In every cache key: a change to the prompts below never reuses scores asked the old way.
PROMPT_VERSION = 1
_SCORE_LINE = re.compile(r"SCORE:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)
POINTWISE_SYSTEM = (
    "You are a judge. Score the final assistant completion of the conversation below against "
    "the rubric, from 0 (worst) to 1 (best).\nRubric: {rubric}\nReason briefly if you like, "
    'then end your answer with a line "SCORE: <a number from 0 to 1>".'
)
GROUP_SYSTEM = (
    "You are a judge. Below are {n} completions of the same conversation, numbered from 1. "
    "Score each against the rubric, relative to the others, from 0 (worst) to 1 (best).\n"
    "Rubric: {rubric}\nAnswer with JSON only, one entry per completion: "
    '{{"scores": [{{"id": 1, "score": 0.5}}, ...]}}'
)


def parse_pointwise(text: str) -> float:
    """The number of the answer's last `SCORE:` line, in [0, 1] (see the module docstring)."""
    found = _SCORE_LINE.findall(text)
    if not found:
        raise ValueError(f"no 'SCORE: <number>' in the judge's answer {text[-200:]!r}")
    return _unit(float(found[-1]), "score")


def parse_group(text: str, n: int) -> list[float]:
    """Scores of completions 1..n from the judge's JSON answer (see the module docstring)."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError(f"no JSON object in the judge's answer {text[-200:]!r}")
    try:
        data = json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"the judge's JSON does not parse: {exc}") from None
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError('the judge\'s JSON has no "scores" list')
    scores: dict[int, float] = {}
    for entry in entries:
        ident = entry.get("id") if isinstance(entry, dict) else None
        value = entry.get("score") if isinstance(entry, dict) else None
        if isinstance(ident, str) and ident.isdigit():
            ident = int(ident)
        if not isinstance(ident, int) or isinstance(ident, bool) or not 1 <= ident <= n:
            raise ValueError(f"entry {entry!r}: id must be one of 1..{n}")
        if ident in scores:
            raise ValueError(f"id {ident} is scored twice")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"entry {entry!r}: score must be a number")
        scores[ident] = _unit(float(value), f"score of id {ident}")
    missing = sorted(set(range(1, n + 1)) - set(scores))
    if missing:
        raise ValueError(f"ids {missing} have no score (of {n} completions)")
    return [scores[i] for i in range(1, n + 1)]


def _unit(value: float, what: str) -> float:
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"{what} {value} is not in [0, 1]")
    return value


def chat_of(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages: a string is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def conversation(chat: list[dict[str, str]], answer: str | None) -> str:
    lines = [f"[{m['role']}] {m['content']}" for m in chat]
    reference = f"\n\nReference answer: {answer}" if answer is not None else ""
    return "Conversation:\n" + "\n".join(lines) + reference
