"""The one SFT routine every backend runs: batches of trajectories -> cross-entropy updates."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from posttrain.algo.advantages import reduction_weights
from posttrain.clients.protocol import TrainingClient
from posttrain.engine.optim import lr_multiplier
from posttrain.trainer.config import SFTConfig
from posttrain.trainer.datums import pad_masks, sft_datum, with_weights
from posttrain.trainer.metrics import StepMetrics
from posttrain.types import AdamParams, TokenSegment, Trajectory


def last_turn_only(trajectory: Trajectory) -> Trajectory:
    """The trajectory with every trainable segment but the last made context."""
    last = max(i for i, s in enumerate(trajectory.segments) if s.trainable)
    segments = tuple(
        s if i == last or not s.trainable else TokenSegment(s.tokens, False, s.logprobs)
        for i, s in enumerate(trajectory.segments)
    )
    return replace(trajectory, segments=segments)


def sft_batches(trajectories: Sequence[Trajectory], config: SFTConfig) -> list[list[Trajectory]]:
    """Shuffled (seeded) batches of `batch_size` for every epoch, in training order."""
    usable = [t for t in trajectories if t.num_trainable_tokens > 0]
    if not usable:
        raise ValueError(
            "train_sft() got no trajectory with trainable tokens; mark assistant segments "
            "trainable=True"
        )
    if config.assistant_turns == "last":
        usable = [last_turn_only(t) for t in usable]
    rng = random.Random(config.shuffle_seed)
    batches: list[list[Trajectory]] = []
    for _ in range(config.epochs):
        order = list(range(len(usable)))
        rng.shuffle(order)
        for start in range(0, len(order), config.batch_size):
            batches.append([usable[i] for i in order[start : start + config.batch_size]])
    return batches


async def train_sft(
    client: TrainingClient,
    trajectories: Sequence[Trajectory],
    config: SFTConfig,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> StepMetrics:
    """Token-mean cross-entropy over each batch, with the configured learning-rate schedule."""
    batches = sft_batches(trajectories, config)
    metrics = StepMetrics(num_trajectories=len(trajectories))
    for index, batch in enumerate(batches):
        pairs = [sft_datum(t) for t in batch]
        masks = [m for _, m in pairs]
        weights_BT = reduction_weights(pad_masks(masks), "token_mean")
        datums = [with_weights(d, weights_BT[i, : m.numel()]) for i, (d, m) in enumerate(pairs)]
        scale = lr_multiplier(
            index,
            warmup_steps=config.warmup_steps,
            total_steps=len(batches),
            decay=config.lr_schedule,
            min_lr_ratio=config.min_lr_ratio,
        )
        adam = AdamParams(
            learning_rate=config.learning_rate * scale,
            weight_decay=config.weight_decay,
            grad_clip_norm=config.grad_clip,
        )
        out = await client.forward_backward(datums, "cross_entropy", {})
        step = await client.optim_step(adam)
        metrics.add_update(
            out.metrics, step.metrics or {}, num_tokens=int(sum(m.sum() for m in masks))
        )
        if on_step is not None:
            on_step(index, out.metrics["loss:sum"])
    return metrics
