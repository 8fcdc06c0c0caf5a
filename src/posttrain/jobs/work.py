"""What a job trains on, behind one interface: a task (prompts; one rewarded completion each),
an environment (seeds; multi-turn episodes) or a `verifiers` environment (its taskset's tasks;
episodes played through the model's OpenAI endpoint). The warm-up, the RL steps and the
evaluations of `train_job` call these.

Everything derives from seeds, so a resumed step replays exactly: RL step k's prompts or
environment seeds (or verifiers tasks) from ([run] seed, k), its sampling seed likewise; the
warm-up's from ([run] seed, "sft"); the held-out problems, seeds or tasks from [eval] seed alone.

Every trajectory's metadata names the policy version that sampled it (`POLICY_VERSION`); an
episode's is the sampler's version when the step's episodes began, a lower bound, since a later
turn may sample newer weights.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from posttrain.data.checks import expect
from posttrain.data.trajectories import SAMPLING_TEMPERATURE, Trajectory, TrajectoryGroup
from posttrain.environments.protocol import Demonstrating, Reset
from posttrain.environments.resolve import ResolvedEnvironment
from posttrain.environments.runner import EpisodeLimits, evaluate_environment, run_episodes
from posttrain.environments.verifiers_adapter import (
    ServesEndpoint,
    evaluate_verifiers,
    load_verifiers_env,
    run_verifiers_episodes,
    verifiers_tasks,
)
from posttrain.inference.protocol import Sampler
from posttrain.jobs.config import JobConfig
from posttrain.rollouts.evaluation import evaluate
from posttrain.rollouts.sft_data import conversation_to_trajectory
from posttrain.rollouts.task_rollouts import (
    POLICY_VERSION,
    SampledStep,
    check_bad_rollouts,
    derive_seed,
    sample_groups,
    sft_examples,
)
from posttrain.tasks import Problem, ResolvedTask, Task
from posttrain.tasks.reward_meter import reward_step
from posttrain.tokenizer import Tokenizer, TurnClosing, assistant_closing
from posttrain.trainer.token_advantages import reads_entropies
from posttrain.types import SamplingParams

if TYPE_CHECKING:  # the optional `verifiers` extra
    from verifiers.v1 import Env
    from verifiers.v1 import Task as VerifiersTask


@dataclass(frozen=True)
class Evaluated:
    """A held-out evaluation: its accuracy, and the values of its `eval` metrics row."""

    accuracy: float
    metrics: dict[str, float]


class JobWork(Protocol):
    """A task or an environment, as the job uses it."""

    @property
    def name(self) -> str: ...

    @property
    def held_out(self) -> int:
        """Problems (or episodes) in each evaluation."""
        ...

    @property
    def unit(self) -> str:
        """What is evaluated, for messages: "problems" or "episodes"."""
        ...

    async def sft_examples(self, tokenizer: Tokenizer) -> list[Trajectory]: ...

    async def sample(self, sampler: Sampler, k: int) -> SampledStep:
        """RL step k's rewarded groups."""
        ...

    async def evaluate(self, sampler: Sampler) -> Evaluated:
        """Greedy accuracy on the held-out problems (or seeds)."""
        ...


def stamp_policy_version(
    groups: Sequence[TrajectoryGroup], version: int | None, temperature: float
) -> None:
    """Record `version` and the sampling `temperature` in the metadata of each trajectory that
    names no version (the parity check compares only tokens sampled at temperature 1 or 0)."""
    if version is None:
        return
    for group in groups:
        for trajectory in group.trajectories:
            if POLICY_VERSION not in trajectory.metadata:
                trajectory.metadata[POLICY_VERSION] = version
                trajectory.metadata[SAMPLING_TEMPERATURE] = temperature


def rl_params(config: JobConfig, k: int) -> SamplingParams:
    """RL step k's sampling settings, seeded by ([run] seed, k); with each token's entropy
    when the configured uncertainty kind reads them."""
    rl = config.rl
    return SamplingParams(
        max_tokens=rl.max_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        stop=rl.stop,
        seed=derive_seed(config.run.seed, "sample", k),
        entropies=reads_entropies(rl.trainer.advantages),
    )


def eval_max_tokens(config: JobConfig) -> int:
    return config.eval.max_tokens or config.rl.max_tokens


@dataclass
class TaskWork:
    """A task: problems drawn per step, `group_size` completions each in one batched call."""

    task: Task
    config: JobConfig
    problems: list[Problem]  # held out: [eval] held_out of them, chosen by [eval] seed

    @property
    def name(self) -> str:
        return self.task.name

    @property
    def held_out(self) -> int:
        return len(self.problems)

    @property
    def unit(self) -> str:
        return "problems"

    async def sft_examples(self, tokenizer: Tokenizer) -> list[Trajectory]:
        rng = random.Random(derive_seed(self.config.run.seed, "sft"))
        problems = self.task.make_prompts(rng, self.config.sft.examples)
        return sft_examples(self.task, problems, tokenizer)

    async def sample(self, sampler: Sampler, k: int) -> SampledStep:
        rl = self.config.rl
        rng = random.Random(derive_seed(self.config.run.seed, "rl", k))
        with reward_step() as meter:  # what the step's rewards cost (a judge's requests)
            step = await sample_groups(
                sampler,
                self.task,
                self.task.make_prompts(rng, rl.prompts_per_step),
                rl.group_size,
                rl_params(self.config, k),
                max_bad_rollouts=rl.max_bad_rollouts,
            )
        return replace(step, metrics={**step.metrics, **meter.metrics()})

    async def evaluate(self, sampler: Sampler) -> Evaluated:
        with reward_step():  # an evaluation has a judge's per-step budget of its own
            result = await evaluate(
                sampler,
                self.task,
                self.problems,
                max_tokens=eval_max_tokens(self.config),
                stop=self.config.rl.stop,
            )
        return Evaluated(result.accuracy, {"accuracy": result.accuracy})


@dataclass
class EnvironmentWork:
    """An environment: `prompts_per_step` seeds per step, `group_size` episodes each."""

    environment: ResolvedEnvironment
    config: JobConfig

    @property
    def name(self) -> str:
        return self.environment.spec

    @property
    def held_out(self) -> int:
        return self.config.eval.held_out

    @property
    def unit(self) -> str:
        return "episodes"

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.config.rl.max_turns, self.config.rl.max_context)

    async def sft_examples(self, tokenizer: Tokenizer) -> list[Trajectory]:
        """Demonstrations of `[sft] examples` training seeds, rendered as episodes are."""
        seed, n = self.config.run.seed, self.config.sft.examples
        closing = assistant_closing(tokenizer)
        return [
            await self._demonstration(derive_seed(seed, "sft", i), tokenizer, closing)
            for i in range(n)
        ]

    async def _demonstration(
        self, seed: int, tokenizer: Tokenizer, closing: TurnClosing
    ) -> Trajectory:
        env = self.environment.make()
        try:
            reset = await _resolved(env.reset(seed, "train"))
            if not isinstance(reset, Reset):
                raise ValueError(f"reset() returned a {type(reset).__name__}, not a Reset")
            if not isinstance(env, Demonstrating):  # resolve_environment checked the class
                raise ValueError(f"{type(env).__name__} has no demonstration()")
            messages = await _resolved(env.demonstration())
            return conversation_to_trajectory(
                [dict(m) for m in expect(messages, Sequence, "demonstration()")],
                tokenizer,
                closing,
                tools=reset.tools,
            )
        except Exception as exc:  # the environment's code may fail in any way: say whose and how
            where = f"[sft] examples: environment {self.name!r}, seed {seed}, demonstration"
            raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from exc
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                await _resolved(close())

    async def sample(self, sampler: Sampler, k: int) -> SampledStep:
        rl = self.config.rl
        seeds = [derive_seed(self.config.run.seed, "env", k, i) for i in range(rl.prompts_per_step)]
        version = sampler.policy_version  # before the first turn: a lower bound
        played = await run_episodes(
            sampler,
            self.environment.make,
            seeds,
            rl_params(self.config, k),
            group_size=rl.group_size,
            limits=self.limits,
            max_exceptions=None,  # the job's bound, below, says how many may fail
            name=self.name,
        )
        check_bad_rollouts(played.errors, played.episodes, rl.max_bad_rollouts)
        stamp_policy_version(played.groups, version, rl.temperature)
        return SampledStep(played.groups, len(played.errors), played.episodes)

    async def evaluate(self, sampler: Sampler) -> Evaluated:
        seeds = [derive_seed(self.config.eval.seed, "held_out", i) for i in range(self.held_out)]
        result = await evaluate_environment(
            sampler,
            self.environment.make,
            seeds,
            max_tokens=eval_max_tokens(self.config),
            limits=self.limits,
            name=self.name,
        )
        metrics = {"accuracy": result.accuracy, "mean_reward": result.mean_reward}
        return Evaluated(result.accuracy, metrics)


async def _resolved(value: object) -> object:
    """What a plain or `async def` method returned."""
    if inspect.isawaitable(value):
        return await value
    return value


@dataclass
class VerifiersWork:
    """A verifiers environment: `prompts_per_step` of its training tasks per step,
    `group_size` episodes each, played through the model's OpenAI endpoint.

    `[eval] held_out` tasks, drawn by `[eval] seed`, are held out; the step's tasks are drawn
    from the others (a verifiers taskset has no split of its own)."""

    environment: ResolvedEnvironment
    config: JobConfig
    model: ServesEndpoint
    env: Env = field(init=False)
    held_out_tasks: list[VerifiersTask] = field(init=False)
    train_tasks: list[VerifiersTask] = field(init=False)

    def __post_init__(self) -> None:
        taskset = self.environment.spec.split(":", 1)[1]
        self.env = load_verifiers_env(
            taskset, self.environment.options, search=self.config.base_dir
        )
        tasks = verifiers_tasks(self.env)
        n = self.config.eval.held_out
        if n >= len(tasks):
            raise ValueError(
                f"[eval] held_out = {n}, but environment {self.name!r} has {len(tasks)} "
                "tasks: hold out fewer, so that some are left to train on"
            )
        rng = random.Random(derive_seed(self.config.eval.seed, "held_out"))
        held = set(rng.sample(range(len(tasks)), n))
        self.held_out_tasks = [t for i, t in enumerate(tasks) if i in held]
        self.train_tasks = [t for i, t in enumerate(tasks) if i not in held]

    @property
    def name(self) -> str:
        return self.environment.spec

    @property
    def held_out(self) -> int:
        return len(self.held_out_tasks)

    @property
    def unit(self) -> str:
        return "episodes"

    async def sft_examples(self, tokenizer: Tokenizer) -> list[Trajectory]:
        return []  # never asked: a verifiers environment has no demonstration() (job_task)

    async def sample(self, sampler: Sampler, k: int) -> SampledStep:
        rl = self.config.rl
        rng = random.Random(derive_seed(self.config.run.seed, "rl", k))
        pool, n = self.train_tasks, rl.prompts_per_step
        tasks = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
        params = rl_params(self.config, k)
        version = sampler.policy_version  # the endpoint serves the same weights: a lower bound
        played = await run_verifiers_episodes(
            self.model,
            self.env,
            tasks,
            group_size=rl.group_size,
            sampling={
                "max_tokens": rl.max_tokens,
                "temperature": rl.temperature,
                "top_p": rl.top_p,
            },
            seed=params.seed,
            max_exceptions=None,  # the job's bound, below, says how many may fail
        )
        check_bad_rollouts(played.errors, played.episodes, rl.max_bad_rollouts)
        stamp_policy_version(played.groups, version, rl.temperature)
        return SampledStep(played.groups, len(played.errors), played.episodes)

    async def evaluate(self, sampler: Sampler) -> Evaluated:
        result = await evaluate_verifiers(
            self.model, self.env, self.held_out_tasks, max_tokens=eval_max_tokens(self.config)
        )
        metrics = {"accuracy": result.accuracy, "mean_reward": result.mean_reward}
        return Evaluated(result.accuracy, metrics)


def job_work(
    config: JobConfig,
    resolved: ResolvedTask | ResolvedEnvironment,
    model: ServesEndpoint | None = None,
) -> JobWork:
    """The job's task or environment, ready for its phases; a verifiers environment plays
    through `model`'s OpenAI endpoint (the job's backend must serve one, as LocalBackend,
    RayBackend and TinkerBackend on `posttrain serve` do)."""
    if isinstance(resolved, ResolvedEnvironment) and resolved.kind == "verifiers":
        if model is None:
            raise ValueError(f"environment {resolved.spec!r} plays through a model: pass model")
        return VerifiersWork(resolved, config, model)
    if isinstance(resolved, ResolvedEnvironment):
        return EnvironmentWork(resolved, config)
    problems = resolved.task.held_out(config.eval.seed, config.eval.held_out)
    return TaskWork(resolved.task, config, problems)
