"""Multi-turn environments: the `Environment` protocol, the rollout runner that turns episodes
into trajectories with several trainable turns, the built-in `calculator` tool-use
environment, finding an environment by name, dotted path or entry point, and playing
`verifiers` environments through a model's OpenAI endpoint (the `verifiers` extra)."""

from posttrain.environments.calculator import CalculatorEnv
from posttrain.environments.protocol import Demonstrating, Environment, Reset, Split, Step
from posttrain.environments.resolve import (
    BUILTIN_ENVIRONMENTS,
    EnvironmentSpecError,
    ResolvedEnvironment,
    resolve_environment,
)
from posttrain.environments.runner import (
    EnvironmentEvaluation,
    EpisodeError,
    EpisodeLimits,
    Episodes,
    evaluate_environment,
    run_episodes,
)
from posttrain.environments.verifiers_adapter import (
    VerifiersEpisodeError,
    evaluate_verifiers,
    load_verifiers_env,
    run_verifiers_episodes,
    verifiers_tasks,
)
from posttrain.rollouts.tool_calls import ToolCall, parse_tool_calls

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "CalculatorEnv",
    "Demonstrating",
    "Environment",
    "EnvironmentEvaluation",
    "EnvironmentSpecError",
    "EpisodeError",
    "EpisodeLimits",
    "Episodes",
    "Reset",
    "ResolvedEnvironment",
    "Split",
    "Step",
    "ToolCall",
    "VerifiersEpisodeError",
    "evaluate_environment",
    "evaluate_verifiers",
    "load_verifiers_env",
    "parse_tool_calls",
    "resolve_environment",
    "run_episodes",
    "run_verifiers_episodes",
    "verifiers_tasks",
]
