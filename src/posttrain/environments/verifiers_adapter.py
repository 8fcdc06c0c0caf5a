"""`verifiers` environments (0.4.0, the optional `verifiers` extra) as posttrain trajectories.

A verifiers environment is a taskset (a module exporting a `vf.Taskset`), played by an `Env`
whose agents run a harness; the harness's model calls go through verifiers' interception
server to an OpenAI-compatible endpoint, and the task's `@vf.reward`s score each trace.
`run_verifiers_episodes` plays `group_size` episodes of each task against a model's own
endpoint (`model.openai_endpoint()`: LocalBackend, RayBackend, or a TinkerBackend on
`posttrain serve`) and makes each episode a `Trajectory`:

- its tokens are those of the responses the model returned, recorded on the way
  (`verifiers_proxy`): each turn's prompt tokens as context, its sampled tokens trainable with
  their logprobs, as `posttrain.data.openai_choices` builds any OpenAI rollout. A turn whose prompt
  does not extend the turns before it (a harness that rewrites or compacts the history) fails
  the episode with that conversion's error; nothing is re-rendered;
- its reward is the trace's (the sum of its weighted `@vf.reward`s); each named reward is also
  a metric (`reward_<name>`), beside the trace's own `@vf.metric`s.

The episodes of one task form a `TrajectoryGroup`. An episode that fails (verifiers records
the error on it, after its own retries), has no model call, or cannot give exact tokens is a
`VerifiersEpisodeError`: dropped whole and returned in `Episodes.errors`; more than
`max_exceptions` of them raise the first, as `run_episodes` does. An episode has one trainable
trace (its agent's); a multi-agent environment marks the other seats `trainable = False`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from posttrain.data.openai_choices import message_of, sampled_turn, segments_from_turns
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.environments.protocol import Environment
from posttrain.environments.resolve import (
    VERIFIERS_PREFIX,
    EnvironmentSpecError,
    ResolvedEnvironment,
)
from posttrain.environments.runner import EnvironmentEvaluation, Episodes
from posttrain.environments.verifiers_proxy import KEY_HEADER, Endpoint, Exchange, RecordingProxy
from posttrain.finder import target_of
from posttrain.rollouts.gather import EpisodeError

if TYPE_CHECKING:
    from verifiers.v1 import Env, Episode, Task, Trace

INSTALL_HINT = "pip install 'posttrain[verifiers]'"
API_KEY_VAR = "POSTTRAIN_VERIFIERS_API_KEY"  # never set: verifiers then sends no real key


class VerifiersEpisodeError(EpisodeError):
    """A verifiers episode that failed, or that cannot become a trajectory; dropped whole."""


class ServesEndpoint(Protocol):
    """A model whose latest weights are served OpenAI-style (a registered TrainableModel)."""

    def openai_endpoint(self) -> Endpoint: ...


def import_verifiers():  # the verifiers.v1 module (untyped here: optional)
    """`verifiers.v1`, or an ImportError that names the extra to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            f"verifiers environments need the verifiers package (0.4.0): {INSTALL_HINT} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return vf


def load_verifiers_env(
    taskset: str, config: Mapping[str, object] | None = None, *, search: Path | None = None
) -> Env:
    """The verifiers environment of `taskset` (its id: an installed package or importable
    module exporting a `vf.Taskset`), built from `config`, the environment's config as
    `vf-eval` takes its `[env]` table (`agent`, `taskset` options, ...). `search` is a
    directory to import the taskset from after `sys.path` (a job's config directory).

    `config["select"]`, posttrain's own key, picks the tasks as `vf-eval --select.*` does
    (verifiers' `SelectConfig`: include, exclude, shuffle, seed, skip, limit); `limit` bounds
    an infinite taskset. An agent's config goes under its seat's name: `agent` in a
    single-agent env, the env's own roles otherwise (TextArena's is `player`)."""
    vf = import_verifiers()
    if search is not None and str(search) not in sys.path:
        sys.path.append(str(search))  # last: an installed package of the same name wins
    data = dict(config or {})
    select = data.pop(SELECT_KEY, None)
    options = data.get("taskset") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"the verifiers env config's taskset must be a table, got {options!r}")
    data["taskset"] = {**options, "id": taskset}
    try:
        env = vf.load_environment(vf.resolve_env_config(data))
    except Exception as exc:  # verifiers' loaders and pydantic fail in many ways: say which
        raise ValueError(
            f"verifiers environment {taskset!r} does not load: {type(exc).__name__}: "
            f"{exc}{_seat_hint(taskset, data)}"
        ) from exc
    if select is not None:
        try:
            env.taskset = env.taskset.select(vf.SelectConfig.model_validate(select))
        except Exception as exc:  # pydantic's, or the taskset refusing a view
            raise ValueError(
                f"verifiers environment {taskset!r}: {SELECT_KEY} = {select!r} is not a task "
                f"selection it takes (verifiers' SelectConfig: include, exclude, shuffle, "
                f"seed, skip, limit): {type(exc).__name__}: {exc}"
            ) from exc
    return env


def _seat_hint(taskset: str, data: Mapping[str, object]) -> str:
    """When the env config has keys its env does not, the seats it has: an agent's config
    goes under its seat's name, which is the env's (`agent` is the single-agent env's)."""
    from verifiers.v1 import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    try:
        fields = env_config_type(taskset, str(data.get("id") or "")).model_fields
    except Exception:  # the taskset itself does not load: its own error says why
        return ""
    unknown = [key for key in data if key not in fields]
    seats = [name for name, f in fields.items() if isinstance(f.default, AgentConfig)]
    if not unknown or not seats:
        return ""
    return (
        f" (this env has no {', '.join(map(repr, unknown))}; its seats are "
        f"{', '.join(map(repr, seats))}: put an agent's config, runtime and limits under its "
        f'seat\'s name, e.g. {seats[0]} = {{ runtime = {{ type = "subprocess" }} }})'
    )


def resolve_verifiers_environment(
    spec: str, options: Mapping[str, object] | None = None, *, search: Path | None = None
) -> ResolvedEnvironment:
    """`"verifiers:<taskset id>"` loaded with `options` (its verifiers env config), as
    `resolve_environment` gives it; EnvironmentSpecError if it does not load. Its episodes are
    played by `run_verifiers_episodes`, not by `run_episodes`: `make` refuses."""
    taskset = spec.removeprefix(VERIFIERS_PREFIX)
    try:
        env = load_verifiers_env(taskset, options, search=search)
    except (ImportError, ValueError) as exc:
        raise EnvironmentSpecError(f"environment {spec!r}: {exc}") from exc
    if not env.taskset.bounded:
        raise EnvironmentSpecError(f"environment {spec!r}: {_INFINITE}")

    def make() -> Environment:
        raise TypeError(
            f"environment {spec!r} is a verifiers environment: its episodes run through "
            "posttrain.environments.verifiers_adapter.run_verifiers_episodes, not run_episodes"
        )

    target = target_of(type(env.taskset))
    return ResolvedEnvironment(make, spec, "verifiers", target, dict(options or {}))


# posttrain's key in a verifiers env config: which tasks to use (verifiers' SelectConfig).
SELECT_KEY = "select"
_INFINITE = (
    "its taskset is infinite; bound it to draw tasks from it: select = { limit = N } in the "
    "env config (a job's [environment]) takes its first N tasks (verifiers' SelectConfig, as "
    'vf-eval --select.limit; or include = { idx = "0:N" })'
)


def verifiers_tasks(env: Env) -> list[Task]:
    """Every task of the environment's taskset, in order; ValueError for an endless one."""
    if not env.taskset.bounded:
        raise ValueError(f"verifiers environment {env.config.env_id!r}: {_INFINITE}")
    return list(env.taskset)


async def run_verifiers_episodes(
    model: ServesEndpoint,
    env: Env,
    tasks: Sequence[Task],
    *,
    group_size: int = 1,
    sampling: Mapping[str, object] | None = None,
    seed: int | None = None,
    max_exceptions: int | None = 0,
) -> Episodes:
    """`group_size` episodes of each task, all at once; see the module docstring.

    `sampling` sets every request's sampling fields (`max_tokens`, `temperature`, `top_p`,
    ...) over what the harness asks. With a `seed`, each episode samples from its own seed
    (derived from `seed`, the task's position and the episode's), so a run repeats.
    `max_exceptions=None` returns every failure without raising (the caller decides).
    """
    vf = import_verifiers()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    endpoint = model.openai_endpoint()
    name = env.config.env_id
    async with RecordingProxy(endpoint) as proxy, env.serving():
        client = vf.EvalClientConfig(
            base_url=proxy.base_url, api_key_var=API_KEY_VAR, headers={KEY_HEADER: proxy.key}
        )

        async def play(position: int, task: Task, member: int) -> Trajectory:
            fields = dict(sampling or {})
            if seed is not None:
                fields["seed"] = _seed(seed, position, member)
            ctx = vf.ModelContext(
                model=endpoint.model_name,
                client=client,
                sampling=vf.Sampling.model_validate(fields),
            )
            episode = await env.run_slot(env.slots(task, 1)[0], ctx)
            recorded = {trace.id: proxy.take(trace.id) for trace in episode.traces}
            return episode_trajectory(episode, recorded, name)

        played = await asyncio.gather(
            *(play(i, task, j) for i, task in enumerate(tasks) for j in range(group_size)),
            return_exceptions=True,
        )
    groups: list[TrajectoryGroup] = []
    errors: list[EpisodeError] = []
    for i in range(len(tasks)):
        kept: list[Trajectory] = []
        for result in played[i * group_size : (i + 1) * group_size]:
            if isinstance(result, VerifiersEpisodeError):
                errors.append(result)
            elif isinstance(result, BaseException):
                raise result  # not the episode's fault (a bug, a cancellation)
            else:
                kept.append(result)
        if kept:
            groups.append(TrajectoryGroup(kept))
    if max_exceptions is not None and len(errors) > max_exceptions:
        raise errors[0]
    return Episodes(groups, errors, len(played))


async def evaluate_verifiers(
    model: ServesEndpoint, env: Env, tasks: Sequence[Task], *, max_tokens: int = 64
) -> EnvironmentEvaluation:
    """One greedy episode per task: accuracy (share with reward >= 1) and mean reward; an
    episode that fails is an error."""
    if not tasks:
        raise ValueError("evaluate_verifiers() got no tasks")
    sampling = {"temperature": 0.0, "max_tokens": max_tokens}
    played = await run_verifiers_episodes(model, env, tasks, sampling=sampling, seed=0)
    return EnvironmentEvaluation.of(played.groups)


def episode_trajectory(
    episode: Episode, recorded: Mapping[str, Sequence[Exchange]], name: str
) -> Trajectory:
    """The trajectory of a played episode's trainable trace, on the responses `recorded` for
    it (by trace id)."""
    where = f"verifiers environment {name!r}, task {episode.task.data.idx}"
    if not episode.ok:
        raise VerifiersEpisodeError(f"{where}: the episode failed: {_errors(episode)}")
    traces = [t for t in episode.traces if t.agent.trainable]
    if len(traces) != 1:
        raise VerifiersEpisodeError(
            f"{where}: the episode has {len(traces)} trainable traces; a trajectory is one "
            "agent's: mark the other seats trainable = False in your Env's setup()"
        )
    try:
        return trace_trajectory(traces[0], recorded.get(traces[0].id, ()))
    except ValueError as exc:
        raise VerifiersEpisodeError(f"{where}, trace {traces[0].id}: {exc}") from exc


def trace_trajectory(trace: Trace, exchanges: Sequence[Exchange]) -> Trajectory:
    """A finished trace as a trajectory: its sampled turns, matched in order with the recorded
    responses that produced them, on those responses' tokens; ValueError if they cannot be."""
    sampled = [n.message for n in trace.nodes if n.sampled]
    if not sampled:
        raise ValueError("the harness made no model call: nothing was sampled to train on")
    matched = _match(sampled, exchanges)
    turns = [
        sampled_turn(
            _choice(e), prompt_token_ids=_prompt_ids(e), where=f"turn {i}'s response choice"
        )
        for i, e in enumerate(matched, start=1)
    ]
    segments = segments_from_turns(turns, [f"turn {i}" for i in range(1, len(turns) + 1)])
    reward = trace.reward
    if not math.isfinite(reward):
        raise ValueError(f"the trace's reward is {reward!r}, not a finite number")
    metrics = {
        **{k: float(v) for k, v in trace.metrics.items() if v is not None},
        **{f"reward_{k}": r.score for k, r in trace.rewards.items() if r is not None},
        "accuracy": float(reward >= 1.0),
        "turns": float(len(turns)),
    }
    last = matched[-1].request
    messages = [*_list(last.get("messages")), message_of(_choice(matched[-1]))]
    metadata = {
        "task": trace.task.data.idx,
        "trace": trace.id,
        "stop_reason": trace.stop_condition,
    }
    return Trajectory(
        segments,
        reward,
        metrics=metrics,
        metadata=metadata,
        messages=messages,
        tools=_list(last.get("tools")) or None,  # pyright: ignore[reportArgumentType]
    )


def _match(sampled: Sequence[object], exchanges: Sequence[Exchange]) -> list[Exchange]:
    """The exchange of each sampled message, in order: a response verifiers did not commit to
    the trace (a retried or abandoned call) is skipped."""
    matched: list[Exchange] = []
    remaining = iter(exchanges)
    for i, message in enumerate(sampled, start=1):
        wanted = (getattr(message, "content", None) or "", _calls(message))
        for exchange in remaining:
            got = message_of(_choice(exchange))
            if (got.get("content") or "", _calls(got)) == wanted:
                matched.append(exchange)
                break
        else:
            raise ValueError(
                f"no recorded response matches turn {i} of the trace ({len(exchanges)} "
                "recorded): its model call did not go through posttrain's endpoint"
            )
    return matched


def _calls(message: object) -> list[tuple[str, str]]:
    """(name, arguments) of a message's tool calls, a verifiers message or a wire dict."""
    if isinstance(message, Mapping):
        calls = message.get("tool_calls") or []
        return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return [(c.name, c.arguments) for c in getattr(message, "tool_calls", None) or []]


def _choice(exchange: Exchange) -> Mapping[str, object]:
    choices = _list(exchange.response.get("choices"))
    if len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise ValueError(f"a response has {len(choices)} choices; a verifiers turn has one")
    return choices[0]


def _prompt_ids(exchange: Exchange) -> Sequence[int] | None:
    ids = exchange.response.get("prompt_token_ids")
    return ids if isinstance(ids, list) else None


def _list(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _errors(episode: Episode) -> str:
    found = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not found:
        return "no error recorded (a trace did not complete)"
    return "; ".join(f"{e.type}: {e.message}" for e in found)


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
