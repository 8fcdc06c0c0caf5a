"""The one SFT routine every backend runs: batches of trajectories -> cross-entropy updates."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

from posttrain.algo.advantages import reduction_weights
from posttrain.clients.protocol import Packing, TrainingClient
from posttrain.data.trajectories import TokenSegment, Trajectory
from posttrain.engine.optim import lr_multiplier
from posttrain.trainer.config import SFTConfig
from posttrain.trainer.datums import pad_masks, require_sequence, sft_datum, with_weights
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.progress import Progress
from posttrain.trainer.steps import RunUpdates, run_now

# Called after each update with its index and {"loss": ..., "learning_rate": ...}.
OnUpdate = Callable[[int, Mapping[str, float]], None]


def last_turn_only(trajectory: Trajectory) -> Trajectory:
    """The trajectory with every trainable segment but the last made context."""
    last = max(i for i, s in enumerate(trajectory.segments) if s.trainable)
    segments = tuple(
        s if i == last or not s.trainable else TokenSegment(s.tokens, False, s.logprobs)
        for i, s in enumerate(trajectory.segments)
    )
    return replace(trajectory, segments=segments)


def sft_batches(trajectories: Sequence[Trajectory], config: SFTConfig) -> list[list[Trajectory]]:
    """Shuffled (seeded) batches of `batch_size` for every epoch, in training order.

    Also checks that the schedule fits them, so every input error surfaces before an update.
    """
    require_sequence(trajectories, "the SFT trajectories")
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
    try:  # the schedule's own check, with what only this call knows
        learning_rate(config, 0, len(batches))
    except ValueError as exc:
        raise ValueError(
            f"the learning-rate schedule does not fit this call's {len(batches)} updates "
            f"({len(usable)} trajectories, batch_size={config.batch_size}, "
            f"epochs={config.epochs}): {exc}"
        ) from None
    return batches


def learning_rate(config: SFTConfig, index: int, total: int) -> float:
    """The learning rate of update `index` (0-based) of `total`: engine.optim's schedule."""
    return config.optimizer.learning_rate * lr_multiplier(
        index,
        warmup_steps=config.warmup_steps,
        total_steps=total,
        decay=config.lr_schedule,
        min_lr_ratio=config.min_lr_ratio,
    )


async def train_sft(
    client: TrainingClient,
    trajectories: Sequence[Trajectory],
    config: SFTConfig,
    *,
    on_update: OnUpdate | None = None,
    run: RunUpdates = run_now,
) -> StepMetrics:
    """Token-mean cross-entropy over each batch, with the configured learning-rate schedule.
    Bad input fails in `sft_batches`, before `run` runs the updates."""
    if config.packing and not isinstance(client, Packing):
        raise ValueError(
            f"train_sft(packing=True): {type(client).__name__} cannot pack sequences (Tinker's "
            "wire protocol does not say how the server lays datums out); use LocalBackend or "
            "RayBackend, or packing=False"
        )
    batches = sft_batches(trajectories, config)
    return await run(
        lambda: train_sft_batches(
            client, batches, config, num_trajectories=len(trajectories), on_update=on_update
        )
    )


async def train_sft_batches(
    client: TrainingClient,
    batches: Sequence[Sequence[Trajectory]],
    config: SFTConfig,
    *,
    num_trajectories: int,
    on_update: OnUpdate | None = None,
) -> StepMetrics:
    """The updates of `train_sft` on batches from `sft_batches` (already validated)."""
    metrics = StepMetrics(num_trajectories=num_trajectories)
    with packed(client, config.packing), Progress("train_sft", len(batches), "update") as progress:
        for index, batch in enumerate(batches):
            out = await _sft_update(client, batch, config, index, len(batches), metrics, on_update)
            progress.update(loss=out)
    return metrics


@contextlib.contextmanager
def packed(client: TrainingClient, packing: bool) -> Iterator[None]:
    """The client's workers pack datums while the updates run (when `packing`), and stop after,
    so later calls on the client (an RL step) run as they did."""
    if not packing:
        yield
        return
    if not isinstance(client, Packing):
        raise ValueError(f"packing=True: {type(client).__name__} cannot pack sequences")
    client.set_packing(True)
    try:
        yield
    finally:
        client.set_packing(False)


async def _sft_update(
    client: TrainingClient,
    batch: Sequence[Trajectory],
    config: SFTConfig,
    index: int,
    total: int,
    metrics: StepMetrics,
    on_update: OnUpdate | None,
) -> float:
    """Update `index` of `total` on one batch; returns its loss (a token mean)."""
    pairs = [sft_datum(t) for t in batch]
    masks = [m for _, m in pairs]
    weights_BT = reduction_weights(pad_masks(masks), "token_mean")
    datums = [with_weights(d, weights_BT[i, : m.numel()]) for i, (d, m) in enumerate(pairs)]
    adam = config.optimizer.adam_params(learning_rate(config, index, total))
    out = await client.forward_backward(datums, "cross_entropy", {})
    step = await client.optim_step(adam)
    optim = step.metrics or {}
    metrics.add_update(out.metrics, optim, num_tokens=int(sum(m.sum() for m in masks)))
    if on_update is not None:
        # The rate the optimizer reports it applied (a remote one may not: the rate sent).
        lr = optim.get("learning_rate:mean", adam.learning_rate)
        on_update(index, {"loss": out.metrics["loss:sum"], "learning_rate": lr})
    return out.metrics["loss:sum"]
