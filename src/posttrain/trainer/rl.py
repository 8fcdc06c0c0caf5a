"""The one RL step every backend runs: groups -> advantages -> datums -> mini-batch updates.

The step talks to a TrainingClient only, so the local, Ray and remote backends share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posttrain.algo.advantages import compute_group_advantages, reduction_weights
from posttrain.algo.losses import LossConfig
from posttrain.clients.protocol import ReferenceScorer, TrainingClient
from posttrain.trainer.config import RLConfig
from posttrain.trainer.datums import pad_masks, require_sequence, rl_datum, with_weights
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.progress import Progress
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import Datum, TrajectoryGroup


@dataclass(frozen=True)
class PreparedBatch:
    """Datums of one RL step with the per-trajectory advantages that produced them."""

    datums: list[Datum]
    masks: list[torch.Tensor]
    advantages: list[float]
    rewards: list[float]
    num_groups: int
    num_zero_variance_groups: int
    num_dropped_groups: int


def prepare_batch(groups: Sequence[TrajectoryGroup], config: RLConfig) -> PreparedBatch:
    """Advantages per group, then one datum per trajectory of every kept group."""
    require_sequence(groups, "the trajectory groups")
    if not groups:
        raise ValueError("train() got an empty list of trajectory groups; pass at least one group")
    result = compute_group_advantages([g.rewards for g in groups], config.advantages)
    datums: list[Datum] = []
    masks: list[torch.Tensor] = []
    advantages: list[float] = []
    for group, adv_G, kept in zip(groups, result.advantages, result.kept, strict=True):
        if not kept:
            continue
        for trajectory, adv in zip(group.trajectories, adv_G.tolist(), strict=True):
            datum, mask = rl_datum(
                trajectory, adv, allow_missing_logprobs=config.loss.allow_training_without_logprobs
            )
            if mask.sum() == 0:
                continue
            datums.append(datum)
            masks.append(mask)
            advantages.append(adv)
    return PreparedBatch(
        datums=datums,
        masks=masks,
        advantages=advantages,
        rewards=[r for g in groups for r in g.rewards],
        num_groups=result.num_groups,
        num_zero_variance_groups=result.num_zero_variance_groups,
        num_dropped_groups=result.num_dropped_groups,
    )


def split_minibatches(count: int, num_minibatches: int) -> list[range]:
    """Contiguous, near-equal ranges; never more mini-batches than datums."""
    parts = max(1, min(num_minibatches, count))
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def weighted(datums: list[Datum], masks: list[torch.Tensor], config: RLConfig) -> list[Datum]:
    """Attach the loss-reduction weights, normalised over this whole mini-batch."""
    reduction = config.advantages
    weights_BT = reduction_weights(
        pad_masks(masks), reduction.loss_reduction, constant=reduction.loss_reduction_constant
    )
    return [
        with_weights(d, weights_BT[i, : m.numel()])
        for i, (d, m) in enumerate(zip(datums, masks, strict=True))
    ]


async def add_reference_inputs(
    client: TrainingClient, datums: list[Datum], config: RLConfig
) -> list[Datum]:
    """Trainer logprobs as the ratio's reference (precalculate_logprobs) and KL reference."""
    if config.precalculate_logprobs:
        allow = config.loss.allow_training_without_logprobs
        scored = await client.forward(
            datums, "importance_sampling", LossConfig(allow_training_without_logprobs=allow)
        )
        datums = [
            _with_inputs(d, logprobs=out["logprobs"], sampler_logprobs=d.loss_fn_inputs["logprobs"])
            for d, out in zip(datums, scored.loss_fn_outputs, strict=True)
        ]
    if config.loss.kl_penalty_coef > 0:
        if not isinstance(client, ReferenceScorer):
            raise TypeError(
                f"kl_penalty_coef needs reference logprobs, which {type(client).__name__} "
                "cannot compute; use a local backend or set kl_penalty_coef=0"
            )
        ref = await client.reference_logprobs(datums)
        datums = [
            _with_inputs(d, ref_logprobs=torch.tensor(r)) for d, r in zip(datums, ref, strict=True)
        ]
    return datums


def _with_inputs(datum: Datum, **inputs: torch.Tensor) -> Datum:
    merged = dict(datum.loss_fn_inputs)
    merged.update(inputs)
    return Datum(datum.model_input, merged)


async def train_rl_step(
    client: TrainingClient,
    groups: Sequence[TrajectoryGroup],
    config: RLConfig,
    *,
    recorder: TensorRecorder | None = None,
) -> StepMetrics:
    """One call of `backend.train`: as many optimizer steps as mini-batches."""
    return await train_rl_batch(client, prepare_batch(groups, config), config, recorder=recorder)


async def train_rl_batch(
    client: TrainingClient,
    batch: PreparedBatch,
    config: RLConfig,
    *,
    recorder: TensorRecorder | None = None,
) -> StepMetrics:
    """The updates of one step on an already prepared (and so already validated) batch."""
    metrics = StepMetrics.for_batch(
        batch.rewards, batch.num_groups, batch.num_zero_variance_groups, batch.num_dropped_groups
    )
    if not batch.datums:
        return metrics.nothing_trainable()
    datums = await add_reference_inputs(client, batch.datums, config)
    adam = config.optimizer.adam_params()
    parts = split_minibatches(len(datums), config.num_minibatches)
    with Progress("train", len(parts), "update") as progress:
        for part in parts:
            mini = weighted([datums[i] for i in part], [batch.masks[i] for i in part], config)
            out = await client.forward_backward(mini, config.policy_loss, config.loss)
            if recorder is not None:
                recorder.record(mini, out)
            step = await client.optim_step(adam)
            tokens = sum(int(batch.masks[i].sum()) for i in part)
            metrics.add_update(out.metrics, step.metrics or {}, num_tokens=tokens)
            progress.update()
    metrics.num_trajectories = len(datums)
    return metrics
