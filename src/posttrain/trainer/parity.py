"""The parity check: is the engine sampling the policy the trainer trains?

An engine that serves the base model, a stale adapter, or skips a sync still returns tokens
and logprobs, and a step trains on them without complaint; only the gap between the engine's
logprobs and the trainer's on the same tokens shows it (`algo.agreement`). This module bounds
that gap's mean |δ| and fails the step (or warns) when the bound is crossed.

Only on-policy tokens are compared: those of trajectories whose metadata names the policy
version (`POLICY_VERSION`) equal to the trainer's current model step, the weights the trainer
holds before the step's first update, sampled at temperature 1 or 0 (at another temperature
the sampler's logprobs are of the tempered distribution, which the trainer does not compute).
`backends.model_steps` probes the engine instead when a step has no such tokens (async RL).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from posttrain.algo.agreement import AgreementSums
from posttrain.data.trajectories import POLICY_VERSION, SAMPLING_TEMPERATURE, JSONScalar

log = logging.getLogger(__name__)

# The largest mean |sampler − trainer logprob| a correct engine shows, per precision, with a
# margin. Evidence (`benchmarks/parity_gap.py`: tiny:qwen2:mini, LoRA 16, 8x8x10 tokens at
# temperature 1, PPO lr 1e-3, 50 steps; the table in docs/engines.md):
#   float32: correct runs (default live engine, split pytorch engine) <= 2.5e-7 a step; the
#     bf16_agreement benchmark's largest fp32 token gap at qwen2.5-0.5b is 2.9e-6. An engine
#     one sync behind: >= 9.0e-3 every step from step 2 on. 5e-4 is 170x the 0.5B token max
#     and 18x below the fault's smallest.
#   bfloat16: correct runs <= 1.6e-3 (split) and 1.1e-3 (live) on the mini model, and the
#     bf16_agreement benchmark measures a mean of 3e-3 (small) and 8e-3 (qwen2.5-0.5b) for the
#     sampler against the trainer. The demo (reverse job, SFT warm-up then 50 RL steps, LoRA 16,
#     `posttrain train`) reached 1.35e-2 with the split engine and 1.19e-2 with the live one
#     (medians 7.9e-3, 6.9e-3). 3e-2 is 2.2x the largest. An engine one sync behind shows 7.5e-2 at
#     step 2 (caught), then 1.2e-2 to 5e-2: bf16 cannot tell a slightly stale adapter from
#     rounding; a base model or a much older one is caught.
PARITY_BOUNDS: Mapping[str, float] = {"float32": 5e-4, "bfloat16": 3e-2}
# The step metric of the gap the check judged: mean |δ| over the tokens it compared.
PARITY_METRIC = "parity_logprob_diff_mean"


def parity_precision(model_dtype: str, engine_dtype: str | None) -> str:
    """Float32 when trainer and engine both compute in fp32, else "bfloat16" (fp16 is held
    to bf16's bound: looser than its own rounding needs)."""
    dtypes = {model_dtype} | ({engine_dtype} if engine_dtype is not None else set())
    return "float32" if dtypes == {"float32"} else "bfloat16"


class ParityError(RuntimeError):
    """The engine's logprobs are too far from the trainer's: it does not sample the policy."""


@dataclass
class ParityCheck:
    """One step's check. `model_step` is the trainer's model step before the step's updates:
    the policy version on-policy tokens claim. `undoable` says whether a failed step's
    accumulated gradients are undone (a checkpoint of `model_step` exists to reload); if not,
    the trainer compares with a forward pass before the first forward_backward instead.
    `compared` adds up what was compared, so a step with nothing to compare can be probed."""

    engine: str
    model_step: int
    precision: str
    mode: Literal["error", "warn"]
    undoable: bool = True
    probe_prompt: tuple[int, ...] | None = None
    compared: AgreementSums = field(default_factory=AgreementSums)

    @property
    def bound(self) -> float:
        return PARITY_BOUNDS[self.precision]

    def metrics(self) -> dict[str, float]:
        """The gap the check judged, as the step's `parity_logprob_diff_mean` (none when it
        compared nothing). Not the step's `logprob_diff_mean`: that one takes every trainable
        token, and an async step's tokens are an older policy's, so it measures staleness."""
        if self.compared.count == 0:
            return {}
        return {PARITY_METRIC: self.compared.abs_mean}

    def on_policy(self, metadata: Mapping[str, JSONScalar]) -> bool:
        """Whether a trajectory's tokens were sampled by the weights the trainer holds now."""
        temperature = metadata.get(SAMPLING_TEMPERATURE, 1.0)
        return metadata.get(POLICY_VERSION) == self.model_step and temperature in (0.0, 1.0)

    def judge(
        self,
        sums: AgreementSums,
        *,
        served: int | None,
        expected: int,
        what: str,
        before_update: bool = True,
    ) -> None:
        """Raise ParityError (mode 'error') or log (mode 'warn') when the mean |δ| of `sums`
        is above the bound; `served` is the version the engine claimed, `what` the tokens,
        `before_update` whether no update of the step was applied yet (else they are undone
        by reloading the last checkpoint)."""
        self.compared += sums
        if sums.count == 0 or sums.abs_mean <= self.bound:
            return
        message = (
            f"the {self.engine!r} engine does not sample the trained policy: it claims policy "
            f"version {served} (expected {expected}), and on {what} ({sums.count} tokens) its "
            f"logprobs differ from the trainer's by {sums.abs_mean:.3g} on average (max "
            f"{sums.abs_max:.3g}), above the {self.precision} bound {self.bound:g}"
        )
        if self.mode == "warn":
            log.warning("%s; training on ([inference] parity_check = 'warn')", message)
            return
        when = "before any update" if before_update else "and its updates are undone"
        raise ParityError(
            f"{message}. The step failed {when}: the model stays at step {self.model_step} "
            "and its last checkpoint is good. If the engine is right and the gap expected, set "
            "[inference] parity_check = 'warn' (log and train on) or 'off'"
        )


def on_policy_flags(
    check: ParityCheck | None, metadata: Sequence[Mapping[str, JSONScalar]]
) -> list[bool]:
    """Per trajectory, whether `check` compares its tokens (none without a check)."""
    if check is None:
        return [False] * len(metadata)
    return [check.on_policy(m) for m in metadata]


def describe_parity(mode: str, model_dtype: str, engine_dtype: str | None, fixed: bool) -> str:
    """What the check does for a job (`posttrain explain`): `engine_dtype` None for the live
    engine (it computes in the trainer's dtype), `fixed` for an engine with sync = 'none'."""
    if mode == "off":
        return "off ([inference] parity_check = 'off')"
    if fixed:
        return "skipped: the engine samples a fixed policy (sync = 'none')"
    precision = parity_precision(model_dtype, engine_dtype)
    action = "fails the step" if mode == "error" else "logs a warning"
    return (
        f"{mode}: {action} when the engine's logprobs differ from the trainer's by more than "
        f"{PARITY_BOUNDS[precision]:g} on average ({precision}), on a step's on-policy tokens "
        "before its first update, else on a probe after the sync"
    )
