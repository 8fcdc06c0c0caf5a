"""Synthetic trajectory groups and weight access for the LocalBackend tests."""

from __future__ import annotations

import random

import torch

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup


def synthetic_groups(seed: int, groups: int = 3, size: int = 4) -> list[TrajectoryGroup]:
    """Random prompts and completions over byte tokens, 0/1 rewards, sampler logprobs near -5."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = TokenSegment(tuple(rng.randrange(3, 250) for _ in range(5)))
        trajs = []
        for _ in range(size):
            n = rng.randrange(2, 7)
            sampled = TokenSegment(
                tuple(rng.randrange(3, 250) for _ in range(n)),
                trainable=True,
                logprobs=tuple(-5.5 + rng.random() for _ in range(n)),
            )
            trajs.append(Trajectory((prompt, sampled), reward=float(rng.random() > 0.5)))
        out.append(TrajectoryGroup(tuple(trajs)))
    return out


def weights_of(backend: LocalBackend, model: TrainableModel) -> dict[str, torch.Tensor]:
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    return {n: p.detach().clone() for n, p in worker.trainable_parameters().items()}
