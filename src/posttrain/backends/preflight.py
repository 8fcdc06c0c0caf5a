"""Preflight: refuse, before any work, a configuration a backend would silently degrade.

Checks options against the backend's capabilities, conflicting options, options the chosen loss
would ignore, and whether the configured advantage flow produces token-varying advantages
(found statically and by probing it on synthetic groups) for a backend that cannot carry them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from posttrain.algo.losses import LossConfig, check_config
from posttrain.backends.capabilities import Capabilities
from posttrain.trainer.config import RLConfig, SFTConfig
from posttrain.trainer.rl import loss_fn_config, prepare_batch
from posttrain.types import TokenSegment, Trajectory, TrajectoryGroup

_RL_DEFAULTS = {f.name: f.default for f in fields(RLConfig)}


@dataclass(frozen=True)
class Problem:
    option: str
    message: str


class PreflightError(ValueError):
    """Every problem preflight found, each naming the option, the backend and the fix."""

    def __init__(self, backend: str, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        lines = [f"  - {p.option}: {p.message}" for p in problems]
        super().__init__(f"{backend} refuses this configuration:\n" + "\n".join(lines))


def _changed(config: RLConfig, name: str) -> bool:
    return getattr(config, name) != _RL_DEFAULTS[name]


def conflicts(config: RLConfig) -> list[Problem]:
    """Options that contradict each other or would have no effect."""
    problems: list[Problem] = []
    if config.truncated_importance_sampling is not None and not config.precalculate_logprobs:
        problems.append(
            Problem(
                "truncated_importance_sampling",
                "needs precalculate_logprobs=True: "
                "the trainer/sampler ratio needs the trainer's own logprobs",
            )
        )
    if config.kl_penalty_coef == 0:
        for name in ("kl_estimator", "kl_mode"):
            if _changed(config, name):
                problems.append(
                    Problem(
                        name,
                        "has no effect with kl_penalty_coef=0; set kl_penalty_coef > 0 or drop it",
                    )
                )
    if config.loss_reduction_constant is not None and config.loss_reduction != "constant":
        problems.append(
            Problem("loss_reduction_constant", "only applies to loss_reduction='constant'")
        )
    if _changed(config, "dro_beta") and config.loss != "dro":
        problems.append(Problem("dro_beta", f"only applies to loss='dro', not {config.loss!r}"))
    if not config.scale_rewards and config.advantage_estimator != "grpo":
        problems.append(
            Problem(
                "scale_rewards",
                f"only applies to advantage_estimator='grpo'; "
                f"{config.advantage_estimator!r} never scales by the std",
            )
        )
    try:
        check_config(config.loss, LossConfig.from_mapping(loss_fn_config(config)))
    except ValueError as exc:
        problems.append(Problem("loss", str(exc)))
    return problems


def synthetic_groups() -> list[TrajectoryGroup]:
    """Two small groups with distinct rewards, lengths and logprobs, to probe the flow."""

    def trajectory(n: int, reward: float) -> Trajectory:
        sampled = TokenSegment(
            tuple(range(10, 10 + n)), True, tuple(-0.1 * (i + 1) for i in range(n))
        )
        return Trajectory((TokenSegment((1, 2, 3)), sampled), reward)

    return [
        TrajectoryGroup((trajectory(3, 1.0), trajectory(5, 0.0), trajectory(4, 0.5))),
        TrajectoryGroup((trajectory(6, 0.2), trajectory(2, 0.9))),
    ]


def token_varying_advantages(config: RLConfig) -> str | None:
    """Why advantages would vary within a sequence, or None (static check, then a probe)."""
    if config.kimi_k2_tau:
        return "kimi_k2_tau shifts each token's advantage by its log-ratio"
    if config.kl_penalty_coef > 0 and config.kl_mode == "advantage":
        return "kl_mode='advantage' shapes each token's advantage by its KL"
    for datum in prepare_batch(synthetic_groups(), config).datums:
        mask = datum.loss_fn_inputs["mask"] > 0
        values = datum.loss_fn_inputs["advantages"][mask]
        if values.numel() and not torch.allclose(values, values[0].expand_as(values)):
            return "the advantage flow gives different advantages to tokens of one sequence"
    return None


def missing_logprobs(config: RLConfig, groups: Sequence[TrajectoryGroup]) -> list[Problem]:
    if config.allow_training_without_logprobs:
        return []
    for gi, group in enumerate(groups):
        for ti, trajectory in enumerate(group.trajectories):
            if any(s.trainable and s.logprobs is None for s in trajectory.segments):
                return [
                    Problem(
                        "allow_training_without_logprobs",
                        f"group {gi} trajectory {ti} has a "
                        "trainable segment without sampler logprobs; sample with logprobs or set "
                        "allow_training_without_logprobs=True (ratio 1)",
                    )
                ]
    return []


def preflight_rl(
    backend: str,
    capabilities: Capabilities,
    config: RLConfig,
    groups: Sequence[TrajectoryGroup] = (),
) -> None:
    """Raise PreflightError listing every problem; return quietly when there is none."""
    problems = conflicts(config)
    if config.kl_penalty_coef > 0 and not capabilities.supports_kl_reference:
        problems.append(
            Problem(
                "kl_penalty_coef",
                f"{backend} cannot score tokens under a reference model; "
                "set kl_penalty_coef=0 or use a backend with supports_kl_reference",
            )
        )
    if not capabilities.preserves_token_advantages:
        reason = token_varying_advantages(config)
        if reason:
            problems.append(
                Problem(
                    "advantages",
                    f"{reason}, but {backend} does not preserve token-level "
                    "advantages (preserves_token_advantages=false); change the options or the backend",
                )
            )
    problems += missing_logprobs(config, groups)
    if problems:
        raise PreflightError(backend, problems)


def preflight_sft(backend: str, capabilities: Capabilities, config: SFTConfig) -> None:
    problems: list[Problem] = []
    if not capabilities.supports_sft:
        problems.append(
            Problem("train_sft", f"{backend} does not support SFT (supports_sft=false)")
        )
    if config.warmup_steps and config.lr_schedule == "constant" and config.min_lr_ratio != 0.0:
        problems.append(Problem("min_lr_ratio", "has no effect with lr_schedule='constant'"))
    if problems:
        raise PreflightError(backend, problems)
