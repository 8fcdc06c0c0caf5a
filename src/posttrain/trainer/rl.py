"""The one RL step every backend runs: groups -> advantages -> datums -> mini-batch updates.

The step talks to a TrainingClient only, so the local, Ray and remote backends share it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from posttrain.algo.advantages import compute_group_advantages, reduction_weights
from posttrain.algo.agreement import AgreementSums, sample_train_agreement
from posttrain.algo.losses import LossConfig
from posttrain.clients.custom_loss import custom_loss, is_custom_loss
from posttrain.clients.futures import APIFuture
from posttrain.clients.protocol import (
    CustomLossClient,
    LogprobChunking,
    ReferenceScorer,
    TrainingClient,
)
from posttrain.data.trajectories import JSONScalar, TrajectoryGroup
from posttrain.trainer.config import RLConfig
from posttrain.trainer.critic import gae_batch, score_values, update_critic
from posttrain.trainer.datums import pad_masks, require_sequence, rl_datum, with_weights
from posttrain.trainer.distill import distill_token_advantages, teacher_logprobs
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.parity import ParityCheck, on_policy_flags
from posttrain.trainer.progress import Progress
from posttrain.trainer.steps import Opener, RunState, RunUpdates, run_now
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.trainer.token_advantages import token_advantages, uses_token_path
from posttrain.types import Datum, ForwardBackwardOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedBatch:
    """Datums of one RL step with the per-trajectory (episode) advantages that produced them,
    the advantage flow's statistics, and the controller state to keep once the step's updates
    are done: `run_state` entries for the model's run_state, saved with the step's checkpoint."""

    datums: list[Datum]
    masks: list[torch.Tensor]
    advantages: list[float]
    rewards: list[float]
    datum_rewards: list[float]  # each datum's trajectory reward (GAE puts it on the last token)
    num_groups: int
    num_zero_variance_groups: int
    num_dropped_groups: int
    metrics: dict[str, float] = field(default_factory=dict[str, float])
    run_state: dict[str, dict[str, JSONScalar]] = field(
        default_factory=dict[str, dict[str, JSONScalar]]
    )
    # Each datum's trajectory metadata: its policy version, read by the parity check.
    metadata: list[Mapping[str, JSONScalar]] = field(default_factory=list[Mapping[str, JSONScalar]])


def prepare_batch(
    groups: Sequence[TrajectoryGroup],
    config: RLConfig,
    *,
    run_state: Mapping[str, object] | None = None,
    tokenizer: Callable[[], object] | None = None,
    teacher_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
) -> PreparedBatch:
    """Advantages per group (per token for a token transform or reinforce_pp), then one datum
    per trajectory of every kept group.

    `run_state` is the model's, read for the SEPA controller's state (never written here);
    `tokenizer` returns the tokenizer that finds planning tokens, called only if needed.
    `teacher_logprobs` (`trainer.distill.score_groups`) makes it a distillation step: each
    token's advantage is teacher − student logprob (plus the mixed-in task advantage), and
    every group is kept.
    """
    require_sequence(groups, "the trajectory groups")
    if not groups:
        raise ValueError("train() got an empty list of trajectory groups; pass at least one group")
    # GAE's advantages come from the critic once the batch is scored (`trainer.critic`): the
    # groups' own statistics are still reported, and none is dropped for equal rewards (the
    # critic's baseline is not the group mean, so such a group still carries a signal).
    # Distillation keeps every group too: the teacher gives each token its own signal.
    advantage_config = config.advantages
    if config.advantages.advantage_estimator == "gae":
        advantage_config = replace(
            advantage_config, advantage_estimator="grpo", zero_variance_groups="keep"
        )
    elif teacher_logprobs is not None:
        advantage_config = replace(advantage_config, zero_variance_groups="keep")
    result = compute_group_advantages([g.rewards for g in groups], advantage_config)
    if teacher_logprobs is not None:
        per_token = distill_token_advantages(
            groups, result, teacher_logprobs, reward_coef=config.distill.distill_reward_coef
        )
    elif uses_token_path(config.advantages):
        per_token = token_advantages(
            groups, result, config.advantages, run_state=run_state, tokenizer=tokenizer
        )
    else:
        per_token = None
    datums: list[Datum] = []
    masks: list[torch.Tensor] = []
    advantages: list[float] = []
    datum_rewards: list[float] = []
    metadata: list[Mapping[str, JSONScalar]] = []
    for g, (group, adv_G, kept) in enumerate(
        zip(groups, result.advantages, result.kept, strict=True)
    ):
        if not kept:
            continue
        for t, (trajectory, adv) in enumerate(zip(group.trajectories, adv_G.tolist(), strict=True)):
            tokens_adv = per_token.per_trajectory[g][t] if per_token is not None else None
            datum, mask = rl_datum(
                trajectory,
                adv if tokens_adv is None else tokens_adv,
                allow_missing_logprobs=config.loss_fn_config.allow_training_without_logprobs,
            )
            if mask.sum() == 0:
                continue
            datums.append(datum)
            masks.append(mask)
            advantages.append(adv)
            datum_rewards.append(trajectory.reward)
            metadata.append(trajectory.metadata)
    return PreparedBatch(
        datums=datums,
        masks=masks,
        advantages=advantages,
        rewards=[r for g in groups for r in g.rewards],
        datum_rewards=datum_rewards,
        num_groups=result.num_groups,
        num_zero_variance_groups=result.num_zero_variance_groups,
        num_dropped_groups=result.num_dropped_groups,
        metrics=per_token.metrics if per_token is not None else {},
        run_state=per_token.run_state if per_token is not None else {},
        metadata=metadata,
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
    client: TrainingClient,
    datums: list[Datum],
    config: RLConfig,
    reference: ReferenceScorer | None = None,
) -> list[Datum]:
    """Trainer logprobs as the ratio's reference (precalculate_logprobs) and KL reference.

    With precalculate_logprobs the datums come back with `logprobs` the trainer's and
    `sampler_logprobs` the sampler's, which `train_rl_batch` also compares (`algo.agreement`).
    The KL reference scores with `reference` (a frozen base model in workers of its own) if
    given, else with the client itself (LoRA off, or a copy inside its workers).
    """
    if config.precalculate_logprobs:
        allow = config.loss_fn_config.allow_training_without_logprobs
        scored = await client.forward(
            datums, "importance_sampling", LossConfig(allow_training_without_logprobs=allow)
        )
        datums = [
            _with_inputs(d, logprobs=out["logprobs"], sampler_logprobs=d.loss_fn_inputs["logprobs"])
            for d, out in zip(datums, scored.loss_fn_outputs, strict=True)
        ]
    if config.loss_fn_config.kl_penalty_coef > 0:
        scorer = reference if reference is not None else client
        if not isinstance(scorer, ReferenceScorer):
            raise TypeError(
                f"kl_penalty_coef needs reference logprobs, which {type(client).__name__} "
                "cannot compute; use a local backend or set kl_penalty_coef=0"
            )
        ref = await scorer.reference_logprobs(datums)
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
    run_state: RunState | None = None,
    recorder: TensorRecorder | None = None,
    critic: Opener[TrainingClient] | None = None,
    reference: Opener[ReferenceScorer | None] | None = None,
    student: str | None = None,
    run: RunUpdates = run_now,
    parity: ParityCheck | None = None,
) -> StepMetrics:
    """One call of `backend.train`: as many optimizer steps as mini-batches (a distillation
    step when the config has a teacher: it scores the groups first).

    Bad input fails before any update: the teacher's vocabulary (`student` names the student
    in that error), then the batch. `run_state` is the model's: its controller state (SEPA) is
    read, and the step's written into it once the updates are done. `critic` is opened for
    advantage_estimator 'gae', `reference` for a KL penalty (None: the client's own).
    `parity` checks the engine's logprobs against the trainer's before the first update.
    """
    name = student if student is not None else f"({type(client).__name__})"
    scored = await teacher_logprobs(config.distill.teacher, client, groups, name)
    # The tokenizer is fetched only to find planning tokens.
    batch = prepare_batch(
        groups, config, run_state=run_state, tokenizer=client.get_tokenizer, teacher_logprobs=scored
    )
    if isinstance(client, LogprobChunking):
        client.set_logprob_chunk_size(config.logprob_calculation_chunk_size)
    gae, kl = (
        config.advantages.advantage_estimator == "gae",
        config.loss_fn_config.kl_penalty_coef > 0,
    )
    value_model = await critic() if critic is not None and gae else None
    scorer = await reference() if reference is not None and kl else None

    async def updates() -> StepMetrics:
        metrics = await train_rl_batch(
            client,
            batch,
            config,
            recorder=recorder,
            critic=value_model,
            reference=scorer,
            parity=parity,
        )
        if run_state is not None:
            run_state.update(batch.run_state)  # saved with this step's checkpoint
        return metrics

    return await run(updates)


async def train_rl_batch(
    client: TrainingClient,
    batch: PreparedBatch,
    config: RLConfig,
    *,
    recorder: TensorRecorder | None = None,
    critic: TrainingClient | None = None,
    reference: ReferenceScorer | None = None,
    parity: ParityCheck | None = None,
) -> StepMetrics:
    """The updates of one step on an already prepared (and so already validated) batch.

    The metrics compare sampler and trainer logprobs on the trainable tokens (`algo.agreement`)
    over the whole step. The trainer's are those of precalculate_logprobs' forward pass, before
    any update; without it, each mini-batch's forward_backward logprobs, so from the second
    mini-batch on the difference also holds the policy's own updates (as tinker-cookbook
    measures it), and only the first of `update_epochs` passes is compared.

    `critic` (advantage_estimator 'gae') scores the batch, gives the policy GAE advantages, and
    is updated beside each policy update on the same mini-batch (`trainer.critic`).
    `reference` scores the KL reference (see `add_reference_inputs`).

    `parity` (`trainer.parity`) judges the on-policy tokens' gap before any optimizer step:
    on the precalculated logprobs, else on the first mini-batch's forward_backward before its
    optim_step (a failure's gradients are undone by the checkpoint reload), or, with no
    checkpoint to reload (`parity.undoable` false), on a forward pass before it.
    """
    metrics = StepMetrics.for_batch(
        batch.rewards, batch.num_groups, batch.num_zero_variance_groups, batch.num_dropped_groups
    )
    metrics.flow = dict(batch.metrics)
    if not batch.datums:
        return metrics.nothing_trainable()
    datums = await add_reference_inputs(client, batch.datums, config, reference)
    on_policy = on_policy_flags(parity, batch.metadata)
    if config.precalculate_logprobs:
        metrics.sample_train = _precalculated_agreement(datums, batch.masks)
        if parity is not None:
            kept = [i for i, keep in enumerate(on_policy) if keep]
            sums = _precalculated_agreement(
                [datums[i] for i in kept], [batch.masks[i] for i in kept]
            )
            _judge(parity, sums)
    critic_datums: list[Datum] = []
    if critic is not None:
        values = await score_values(critic, datums, batch.masks)
        scored = gae_batch(datums, batch.masks, batch.datum_rewards, values, config)
        datums, critic_datums = scored.policy_datums, scored.critic_datums
        metrics.flow.update(scored.metrics)
    adam = config.optimizer.adam_params()
    parts = split_minibatches(len(datums), config.num_minibatches)
    updates = [(epoch, part) for epoch in range(config.update_epochs) for part in parts]
    with Progress("train", len(updates), "update") as progress:
        for index, (epoch, part) in enumerate(updates):
            masks = [batch.masks[i] for i in part]
            mini = weighted([datums[i] for i in part], masks, config)
            # Without precalculated logprobs the first update's tokens are judged, before its
            # optim_step.
            first = index == 0 and not config.precalculate_logprobs
            judge = parity if first else None
            keep = [on_policy[i] for i in part]
            if judge is not None and not judge.undoable:
                _judge(judge, await _forward_agreement(client, mini, masks, keep, config))
            out = await _forward_backward(client, mini, config)
            if epoch == 0 and not config.precalculate_logprobs:
                metrics.sample_train += _update_agreement(mini, masks, out)
            if judge is not None and judge.undoable:
                _judge(judge, _update_agreement(mini, masks, out, keep))
            if recorder is not None:
                recorder.record(mini, out)
            step = await client.optim_step(adam)
            tokens = sum(int(m.sum()) for m in masks)
            metrics.add_update(
                out.metrics, step.metrics or {}, num_tokens=tokens, new_tokens=epoch == 0
            )
            if critic is not None:
                value_mini = weighted([critic_datums[i] for i in part], masks, config)
                value_out, value_step = await update_critic(critic, value_mini, config)
                metrics.add_critic_update(value_out.metrics, value_step, num_tokens=tokens)
            if config.verbose:
                _log_update(
                    progress.done, len(updates), tokens, {**out.metrics, **(step.metrics or {})}
                )
            progress.update()
    metrics.num_trajectories = len(datums)
    return metrics


def _precalculated_agreement(datums: list[Datum], masks: list[torch.Tensor]) -> AgreementSums:
    """Sampler vs trainer logprobs as `add_reference_inputs` left them in each datum."""
    total = AgreementSums()
    for datum, mask_T in zip(datums, masks, strict=True):
        inputs = datum.loss_fn_inputs
        total += sample_train_agreement(inputs["sampler_logprobs"], inputs["logprobs"], mask_T)
    return total


def _update_agreement(
    datums: list[Datum],
    masks: list[torch.Tensor],
    out: ForwardBackwardOutput,
    keep: Sequence[bool] | None = None,
) -> AgreementSums:
    """Sampler logprobs vs the mini-batch's forward_backward logprobs (one per target token),
    on the datums `keep` marks (all without it).

    A datum whose output has no `logprobs` of its targets' length (a client that does not
    return them) is left out rather than failing the step.
    """
    total = AgreementSums()
    if len(out.loss_fn_outputs) != len(datums):
        return total
    kept = [True] * len(datums) if keep is None else keep
    for datum, mask_T, output, k in zip(datums, masks, out.loss_fn_outputs, kept, strict=True):
        if not k:
            continue
        trainer_logp = output.get("logprobs")
        if trainer_logp is None or trainer_logp.numel() != mask_T.numel():
            continue
        sampler_logp_T = datum.loss_fn_inputs["logprobs"].reshape(-1)
        total += sample_train_agreement(sampler_logp_T, trainer_logp.reshape(-1).cpu(), mask_T)
    return total


async def _forward_agreement(
    client: TrainingClient,
    datums: list[Datum],
    masks: list[torch.Tensor],
    keep: Sequence[bool],
    config: RLConfig,
) -> AgreementSums:
    """Sampler vs trainer logprobs of the `keep` datums from a forward pass (no gradients)."""
    kept = [i for i, k in enumerate(keep) if k]
    if not kept:
        return AgreementSums()
    allow = config.loss_fn_config.allow_training_without_logprobs
    scored = await client.forward(
        [datums[i] for i in kept],
        "importance_sampling",
        LossConfig(allow_training_without_logprobs=allow),
    )
    return _update_agreement([datums[i] for i in kept], [masks[i] for i in kept], scored)


def _judge(parity: ParityCheck, sums: AgreementSums) -> None:
    """The step's on-policy tokens: the engine claimed the trainer's version for them."""
    step = parity.model_step
    parity.judge(sums, served=step, expected=step, what="this step's on-policy tokens")


def _forward_backward(
    client: TrainingClient, datums: list[Datum], config: RLConfig
) -> APIFuture[ForwardBackwardOutput]:
    """The configured loss on `datums`: a built-in by name, a registered one on the logprobs."""
    name = config.loss_fn
    if not is_custom_loss(name):
        return client.forward_backward(datums, name, config.loss_fn_config)
    if not isinstance(client, CustomLossClient):
        raise TypeError(
            f"loss={name!r} is a custom loss, which needs forward_backward_custom; "
            f"{type(client).__name__} does not have it"
        )
    return client.forward_backward_custom(datums, custom_loss(name))


def _log_update(index: int, count: int, tokens: int, values: Mapping[str, float]) -> None:
    """The `verbose` option's line per update: which update, its tokens and its metrics."""
    shown = " ".join(f"{key}={value:.6g}" for key, value in sorted(values.items()))
    log.info("update %d/%d: %d tokens %s", index + 1, count, tokens, shown)
