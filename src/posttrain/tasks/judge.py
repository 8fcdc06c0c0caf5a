"""LLM judges: rewards from a model behind any OpenAI-compatible `/v1/chat/completions` endpoint
(`posttrain serve`, vLLM, a hosted API), as a dataset task's reward (`[data] reward = "judge"`
with a `[judge]` table) or from Python (`await judge.score(prompt, completion)`).

Two modes:
- `pointwise`: one request per completion. The judge is asked to end its answer with a line
  `SCORE: <number>`; the score is the number of the last such line (case aside), and must be in
  [0, 1]. An answer without one, or with a number outside [0, 1], is unparsable.
- `group`: one request per prompt's group, as ART's RULER does: the judge sees every completion
  of the group, numbered from 1, and scores them relative to each other. It must answer with a
  JSON object `{"scores": [{"id": 1, "score": 0.7}, ...]}` (the text from its first `{` to its
  last `}` is parsed): exactly one entry per id 1..n, each score a number in [0, 1]. A missing,
  repeated or extra id is unparsable.

Each request is retried (`retries`, waiting `backoff_s`, doubled each time) after a transport
error, a timeout, an HTTP 429 or 5xx, or an unparsable answer; other HTTP errors are not
retried. At most `max_concurrency` requests run at once. Within one RL step (a `reward_step()`:
the job opens one per RL step and per evaluation; outside one no budget holds) at most
`max_calls_per_step` requests are made and none runs past `max_seconds_per_step` after the
step's first request began. A request that fails
for good, or that the budget refuses, raises `JudgeError`, a `RewardError`: the job counts the
rollout (in group mode, the group's rollouts) as bad, against `[rl] max_bad_rollouts`; it is
never scored 0.

Scores are cached on (judge model, rubric, mode, the prompt's chat, the reference answer, the
completion, or in group mode the group's completions in order): in memory, and in a SQLite file
when `cache` names one (the job's is `judge_cache.sqlite` in the run directory), so a resumed
run that samples the same rollouts makes no request for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from posttrain.algo.config_fields import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, option
from posttrain.algo.config_fields import from_options as build_options
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.tasks.judge_prompts import (
    GROUP_SYSTEM,
    POINTWISE_SYSTEM,
    PROMPT_VERSION,
    Prompt,
    chat_of,
    conversation,
    parse_group,
    parse_pointwise,
)
from posttrain.tasks.protocol import Problem
from posttrain.tasks.reward_meter import RewardMeter, current_meter
from posttrain.tasks.rewards import GroupRewardFn, RewardError
from posttrain.types import StopReason

if TYPE_CHECKING:  # the optional `judge` extra
    import httpx

JudgeMode = Literal["pointwise", "group"]
_RETRIED_STATUS = (429, 500, 502, 503, 504)


class JudgeError(RewardError):
    """A judge that failed for good: an HTTP error after its retries, an unparsable answer, or
    a step's budget spent. A bad rollout, never a score of 0."""


class _Retry(Exception):
    """A failure worth another attempt (a transport error, 429/5xx, an unparsable answer)."""


@dataclass(frozen=True)
class JudgeConfig:
    """`[judge]`: the judge of `[data] reward = "judge"` (`posttrain.tasks.judge`)."""

    base_url: str = option("", "the OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    model: str = option("", "the judge model's name at that endpoint")
    rubric: str = option("", "what makes a completion good, in words the judge reads")
    mode: JudgeMode = option(
        "pointwise", "pointwise: one request per completion; group: one per prompt's group"
    )
    api_key_env: str | None = option(
        None, "the environment variable holding the endpoint's API key (None: no key)"
    )
    max_calls_per_step: int | None = option(
        None, "requests per RL step, retries included (None: no limit)", AT_LEAST_ONE
    )
    max_seconds_per_step: float | None = option(
        None, "seconds from a step's first request after which none runs (None: no limit)", POSITIVE
    )
    retries: int = option(2, "retries of a failed request (HTTP 429/5xx, timeout, unparsable)")
    backoff_s: float = option(
        0.5, "the wait before the first retry, doubled each retry", NON_NEGATIVE
    )
    max_concurrency: int = option(8, "requests in flight at once", AT_LEAST_ONE)
    timeout_s: float = option(60.0, "seconds per request", POSITIVE)
    max_tokens: int = option(512, "tokens of the judge's answer", AT_LEAST_ONE)
    temperature: float = option(0.0, "the judge's sampling temperature", NON_NEGATIVE)

    def __post_init__(self) -> None:
        from posttrain.trainer.config import check_field_types

        check_field_types(self)
        for key in ("base_url", "model", "rubric"):
            if not getattr(self, key).strip():
                raise ValueError(f"[judge] {key} is required")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"[judge] base_url {self.base_url!r} must be an http(s) URL, e.g. "
                "http://127.0.0.1:8000/v1"
            )
        if self.retries < 0:
            raise ValueError(f"[judge] retries must be >= 0, got {self.retries}")
        if self.api_key_env is not None and not self.api_key_env:
            raise ValueError(
                "[judge] api_key_env names an environment variable; remove it or name one"
            )


class Judge:
    """An LLM judge: `Judge(base_url=..., model=..., rubric=..., mode="group")`, or
    `Judge(config)`; the other keywords are `JudgeConfig`'s. `cache` is a SQLite file for
    scores (None: in memory only). `stats` counts requests, cache hits, failures and seconds
    over the judge's life; within `reward_step()` the step's meter counts them too."""

    def __init__(
        self,
        config: JudgeConfig | None = None,
        /,
        *,
        cache: str | Path | None = None,
        **options: object,
    ) -> None:
        if config is not None and options:
            raise TypeError("give a JudgeConfig or its options as keywords, not both")
        self.config = config if config is not None else build_options(JudgeConfig, options)
        self.cache_path = Path(cache) if cache is not None else None
        self.stats = RewardMeter()
        self._memory: dict[str, list[float]] = {}
        self._db: sqlite3.Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._inflight: dict[str, asyncio.Future[list[float]]] = {}
        self._headers = {"Content-Type": "application/json"}
        if self.config.api_key_env is not None:
            key = os.environ.get(self.config.api_key_env)
            if not key:
                raise ValueError(
                    f"[judge] api_key_env = {self.config.api_key_env!r}, but that environment "
                    "variable is not set: export it, or remove api_key_env for an endpoint "
                    "without keys"
                )
            self._headers["Authorization"] = f"Bearer {key}"
        if importlib.util.find_spec("httpx") is None:
            raise ImportError("the LLM judge needs httpx: pip install 'posttrain[judge]'")

    spec = "judge"  # how a dataset task names this reward

    @property
    def group_reward(self) -> GroupRewardFn | None:
        """`score_problem_group` in group mode (the job then scores each group in one
        request), else None (each completion alone, through `reward`)."""
        return self.score_problem_group if self.config.mode == "group" else None

    def use_cache(self, path: str | Path) -> None:
        """Keep scores in the SQLite file `path` from now on (the job's run directory)."""
        self.close()
        self.cache_path = Path(path)

    async def score(self, prompt: Prompt, completion: str, *, answer: str | None = None) -> float:
        """The judge's score of one completion, in [0, 1] (pointwise, whatever the mode)."""
        chat = chat_of(prompt)
        key = self._key("pointwise", chat, answer, [completion])
        system = POINTWISE_SYSTEM.format(rubric=self.config.rubric)
        user = f"{conversation(chat, answer)}\n\nCompletion to score:\n{completion}"
        scores = await self._scored(key, system, user, lambda text: [parse_pointwise(text)])
        return scores[0]

    async def score_group(
        self, prompt: Prompt, completions: Sequence[str], *, answer: str | None = None
    ) -> list[float]:
        """The judge's scores of a group of completions, relative to each other, in one request."""
        if not completions:
            return []
        chat, n = chat_of(prompt), len(completions)
        key = self._key("group", chat, answer, list(completions))
        system = GROUP_SYSTEM.format(n=n, rubric=self.config.rubric)
        shown = "\n\n".join(f"Completion {i}:\n{c}" for i, c in enumerate(completions, start=1))
        user = f"{conversation(chat, answer)}\n\n{shown}"
        return await self._scored(key, system, user, lambda text: parse_group(text, n))

    async def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        """A task reward: the completion's score in the judge's mode (a group of one in group
        mode); errors name the problem."""
        scores = await self.score_problem_group(problem, [completion], [stop_reason])
        return scores[0]

    async def score_problem_group(
        self, problem: Problem, completions: Sequence[str], stop_reasons: Sequence[StopReason]
    ) -> list[float]:
        """A task's group reward: the scores of a problem's completions in the judge's mode."""
        del stop_reasons  # the judge reads the text, cut or not
        try:
            if self.config.mode == "group":
                return await self.score_group(problem.chat(), completions, answer=problem.answer)
            return list(
                await asyncio.gather(
                    *(self.score(problem.chat(), c, answer=problem.answer) for c in completions)
                )
            )
        except JudgeError as exc:
            raise JudgeError(f"{exc} (on {problem.where()})") from exc

    async def rescore(self, group: TrajectoryGroup) -> TrajectoryGroup:
        """`group` with each trajectory's reward set to the judge's score of its last assistant
        message, given the messages before it: `gather_groups(..., after_each=judge.rescore)`,
        as ART's RULER. In group mode the trajectories must share their prompt."""
        prompts, completions = [], []
        for trajectory in group.trajectories:
            messages = [
                {"role": str(m.get("role")), "content": str(m.get("content") or "")}
                for m in trajectory.messages
            ]
            if not messages or messages[-1]["role"] != "assistant":
                raise JudgeError("judge.rescore: a trajectory does not end with an assistant turn")
            prompts.append(messages[:-1])
            completions.append(messages[-1]["content"])
        if self.config.mode == "group" and completions:
            if any(p != prompts[0] for p in prompts):
                raise JudgeError("judge.rescore in group mode: the group's prompts differ")
            scores = await self.score_group(prompts[0], completions)
        else:
            scores = await asyncio.gather(
                *(self.score(p, c) for p, c in zip(prompts, completions, strict=True))
            )
        for trajectory, value in zip(group.trajectories, scores, strict=True):
            trajectory.reward = value
        return group

    async def _scored(
        self, key: str, system: str, user: str, parse: Callable[[str], list[float]]
    ) -> list[float]:
        meter = current_meter()
        if meter is not None:  # a judged step always has its judge metrics, 0 or not
            for name in ("judge_calls", "judge_cache_hits", "judge_failures", "judge_s"):
                meter.add(name, 0.0)
        found = self._cached(key)
        if found is None and key in self._inflight:
            found = await asyncio.shield(self._inflight[key])
        if found is not None:
            self._count(meter, "judge_cache_hits")
            return found
        pending = asyncio.get_running_loop().create_future()
        self._inflight[key] = pending
        try:
            scores = await self._ask(system, user, parse, meter)
        except asyncio.CancelledError:
            pending.cancel()
            raise
        except Exception as exc:
            if isinstance(exc, JudgeError):
                self._count(meter, "judge_failures")
            pending.set_exception(exc)
            pending.exception()  # retrieved: no "never retrieved" warning when none waits
            raise
        finally:
            del self._inflight[key]
        self._store(key, scores)
        pending.set_result(scores)
        return scores

    async def _ask(
        self,
        system: str,
        user: str,
        parse: Callable[[str], list[float]],
        meter: RewardMeter | None,
    ) -> list[float]:
        """One request, retried; the step's budget checked before each attempt."""
        config = self.config
        problem: Exception | None = None
        for attempt in range(config.retries + 1):
            if attempt:
                await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1))
            remaining = self._check_budget(meter, problem)
            self._count(meter, "judge_calls")  # counted now: concurrent requests see it
            try:
                text = await asyncio.wait_for(self._request(system, user, meter), remaining)
                return parse(text)
            except TimeoutError:
                if remaining < config.timeout_s:
                    spent = f"budget: max_seconds_per_step = {config.max_seconds_per_step} spent"
                    raise self._error(spent, problem) from None
                problem = TimeoutError(f"no answer within timeout_s = {config.timeout_s}")
            except JudgeError:
                raise  # an HTTP error that another try would not change (401, 404, ...)
            except (_Retry, ValueError) as exc:  # ValueError: an unparsable answer
                problem = exc
        raise self._error(f"failed after {config.retries + 1} attempts", problem)

    def _check_budget(self, meter: RewardMeter | None, problem: Exception | None) -> float:
        """Seconds this attempt may take; a JudgeError when the step's budget is spent (a
        budget holds within a `reward_step()` only)."""
        config = self.config
        calls, seconds = config.max_calls_per_step, config.max_seconds_per_step
        if meter is not None and calls is not None and meter.count("judge_calls") >= calls:
            raise self._error(f"budget: max_calls_per_step = {calls} spent", problem)
        if meter is None or seconds is None:
            return config.timeout_s
        left = meter.began("judge") + seconds - time.perf_counter()
        if left <= 0:
            raise self._error(f"budget: max_seconds_per_step = {seconds} spent", problem)
        return min(left, config.timeout_s)

    async def _request(self, system: str, user: str, meter: RewardMeter | None) -> str:
        import httpx

        body = {
            "model": self.config.model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        async with self._slots_of_loop():
            self._span(meter, "began")
            try:
                response = await self._client().post(
                    self.config.base_url.rstrip("/") + "/chat/completions",
                    json=body,
                    headers=self._headers,
                    timeout=self.config.timeout_s,
                )
            except httpx.TransportError as exc:  # timeouts included
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
            finally:
                self._span(meter, "ended")
        if response.status_code in _RETRIED_STATUS:
            raise _Retry(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code != 200:
            raise self._error(f"HTTP {response.status_code}: {response.text[:300]}", None)
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Retry(f"not a chat completion: {response.text[:200]}") from None
        if not isinstance(content, str):
            raise _Retry(f"the answer's content is {content!r}, not text")
        return content

    def _error(self, what: str, problem: Exception | None) -> JudgeError:
        last = f"; last error: {problem}" if problem is not None else ""
        return JudgeError(f"judge {self.config.model!r} at {self.config.base_url}: {what}{last}")

    def _count(self, meter: RewardMeter | None, name: str) -> None:
        self.stats.add(name)
        if meter is not None:
            meter.add(name)

    def _span(self, meter: RewardMeter | None, edge: Literal["began", "ended"]) -> None:
        for each in (self.stats, meter):
            if each is not None and edge == "began":
                each.began("judge")
            elif each is not None:
                each.ended("judge")

    def _slots_of_loop(self) -> asyncio.Semaphore:
        self._client()  # a new event loop gets new slots and a new client
        return self._slots

    def _client(self) -> httpx.AsyncClient:
        import httpx

        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            self._loop = loop
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
            self._http = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=self.config.max_concurrency)
            )
        return self._http

    def _key(
        self, mode: str, chat: list[dict[str, str]], answer: str | None, completions: list[str]
    ) -> str:
        parts = [PROMPT_VERSION, self.config.model, self.config.rubric, mode, chat, answer]
        text = json.dumps([*parts, completions], ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def _cached(self, key: str) -> list[float] | None:
        if key in self._memory:
            return self._memory[key]
        db = self._database()
        if db is None:
            return None
        row = db.execute("SELECT scores FROM scores WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        scores = [float(s) for s in json.loads(row[0])]
        if not all(math.isfinite(s) for s in scores):
            return None
        self._memory[key] = scores
        return scores

    def _store(self, key: str, scores: list[float]) -> None:
        self._memory[key] = scores
        db = self._database()
        if db is not None:
            with db:  # one transaction per score: a crash keeps every score written before it
                db.execute(
                    "INSERT OR REPLACE INTO scores (key, scores) VALUES (?, ?)",
                    (key, json.dumps(scores)),
                )

    def _database(self) -> sqlite3.Connection | None:
        if self.cache_path is None:
            return None
        if self._db is None:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.cache_path)
            with self._db:
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS scores (key TEXT PRIMARY KEY, scores TEXT NOT NULL)"
                )
        return self._db

    def close(self) -> None:
        """Close the cache file (the HTTP client closes with its event loop)."""
        if self._db is not None:
            self._db.close()
            self._db = None
