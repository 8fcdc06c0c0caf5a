"""Trajectories to Datums on the exact tokens the sampler produced.

A trajectory's tokens t_0..t_n become `model_input = t_0..t_{n-1}` and
`target_tokens = t_1..t_n`; every per-token input is aligned to the target it scores. A target
is trainable when its segment is (sampled assistant tokens); prompt, user and tool tokens are
context only. Chat templates are never re-rendered here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.types import Datum, ModelInput


def require_sequence(items: object, name: str) -> None:
    """The trainer reads its inputs more than once: a one-shot iterable (a generator) would be
    empty the second time, a step that trains nothing. Backends pass lists (`backends.inputs`)."""
    if not isinstance(items, Sequence):
        raise TypeError(
            f"{name} must be a sequence (a list or tuple), got a {type(items).__name__}: "
            "it is read more than once; pass list(...) of it"
        )


def missing_logprobs(groups: Sequence[TrajectoryGroup], *, allowed: bool) -> str | None:
    """The first trajectory with a trainable segment but no sampler logprobs, unless `allowed`
    (allow_training_without_logprobs: ratio 1), as the error that names it; else None."""
    if allowed:
        return None
    for gi, group in enumerate(groups):
        for ti, trajectory in enumerate(group.trajectories):
            if any(s.trainable and s.logprobs is None for s in trajectory.segments):
                return (
                    f"group {gi} trajectory {ti} has a "
                    "trainable segment without sampler logprobs; sample with logprobs or set "
                    "allow_training_without_logprobs=True (ratio 1)"
                )
    return None


def trajectory_arrays(
    trajectory: Trajectory, *, allow_missing_logprobs: bool
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Tokens, the trainable mask of each target, and sampler logprobs (NaN where unknown)."""
    tokens: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    for index, segment in enumerate(trajectory.segments):
        if segment.trainable and segment.logprobs is None and not allow_missing_logprobs:
            raise ValueError(
                f"trajectory segment {index} is trainable but has no sampler logprobs; sample "
                "with logprobs, or pass allow_training_without_logprobs=True to use ratio 1"
            )
        tokens.extend(segment.tokens)
        mask.extend([1.0 if segment.trainable else 0.0] * len(segment.tokens))
        lps = segment.logprobs if segment.logprobs is not None else [math.nan] * len(segment.tokens)
        logprobs.extend(lps if segment.trainable else [math.nan] * len(segment.tokens))
    if len(tokens) < 2:
        raise ValueError(
            "a trajectory needs at least 2 tokens to train on (a context and a target)"
        )
    # Shift by one: position i predicts token i+1, so drop the first token's mask and logprob.
    return tokens, torch.tensor(mask[1:]), torch.tensor(logprobs[1:])


def rl_datum(
    trajectory: Trajectory,
    advantage: float | torch.Tensor,
    *,
    allow_missing_logprobs: bool = False,
) -> tuple[Datum, torch.Tensor]:
    """One RL datum (advantages, behaviour logprobs, mask) and its trainable mask [T].

    `advantage` is one value for every trainable target, or a 1-D tensor of one value per
    trainable target, in order (a token transform's output).
    """
    tokens, mask_T, logprobs_T = trajectory_arrays(
        trajectory, allow_missing_logprobs=allow_missing_logprobs
    )
    if isinstance(advantage, torch.Tensor):
        trainable = mask_T > 0
        if advantage.shape != (int(trainable.sum()),):
            raise ValueError(
                f"per-token advantages of shape {tuple(advantage.shape)} for a trajectory with "
                f"{int(trainable.sum())} trainable targets; give one value per trainable target"
            )
        adv_T = torch.zeros_like(mask_T)
        adv_T[trainable] = advantage.to(adv_T.dtype)
    else:
        adv_T = mask_T * advantage
    # Untrainable positions carry logprob 0 rather than NaN: the loss never reads them, and
    # NaN would trip the missing-logprobs check meant for trainable tokens.
    logprobs_T = torch.where(mask_T > 0, logprobs_T, torch.zeros_like(logprobs_T))
    datum = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {
            "target_tokens": tokens[1:],
            "logprobs": logprobs_T,
            "advantages": adv_T,
            "mask": mask_T,
        },
    )
    return datum, mask_T


def sft_datum(trajectory: Trajectory) -> tuple[Datum, torch.Tensor]:
    """A cross-entropy datum whose weights are the trainable mask (reduction applied later)."""
    tokens, mask_T, _ = trajectory_arrays(trajectory, allow_missing_logprobs=True)
    datum = Datum(
        ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": mask_T}
    )
    return datum, mask_T


def with_weights(datum: Datum, weights_T: torch.Tensor) -> Datum:
    """The same datum with its `weights` input replaced."""
    inputs = dict(datum.loss_fn_inputs)
    inputs["weights"] = weights_T
    return Datum(datum.model_input, inputs)


def pad_masks(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack 1-D masks of different lengths into [B, T] with zero padding."""
    out = torch.zeros(len(masks), max((m.numel() for m in masks), default=0))
    for row, mask in enumerate(masks):
        out[row, : mask.numel()] = mask
    return out
