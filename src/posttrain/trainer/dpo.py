"""The one DPO routine every backend runs: preference pairs -> reference logprobs -> updates.

Each pair becomes two datums, chosen then rejected, adjacent in every batch: the prompt and
completion as one sequence, `weights` 1 on the completion's targets (the prompt is context).
The loss is a registered custom loss (`dpo_sigmoid`, `dpo_ipo`) that runs through
`forward_backward_custom` on the logprobs, so it runs the same wherever the logprobs come from
(a local model, Ray workers, a remote Tinker-protocol server). The loss reads all it needs from
the datums: `ref_logprobs`, `dpo_beta` and `pair_weight`.

As every loss, it is a sum: Σ_pairs pair_weight·ℓ_pair, with pair_weight = 1/(pairs in the
update) set here. A pair is never split across `forward_backward` calls, so the gradient does
not depend on how the batch is cut into calls or micro-batches.

The reference logprobs are computed once, for every pair, before the call's first update:
with the base model (`reference="base"`: the client's `reference_logprobs`) or with the policy
as it is at the start of the call (`reference="initial"`: a `forward` pass).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import get_args

import torch

from posttrain.algo.dpo import AVERAGES_TOKENS, PairLoss, pair_loss, sequence_logp
from posttrain.algo.losses import LossConfig
from posttrain.clients.custom_loss import CustomLossFn, custom_loss, register_loss
from posttrain.clients.protocol import CustomLossClient, ReferenceScorer, TrainingClient
from posttrain.data.preferences import PreferencePair, check_pairs
from posttrain.trainer.config import DPOConfig
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.progress import Progress
from posttrain.trainer.steps import Opener, RunUpdates, run_now
from posttrain.types import Datum, ModelInput

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")
REQUIRED = ("weights", "ref_logprobs", "dpo_beta", "pair_weight")


def loss_name(loss: PairLoss) -> str:
    """The registered custom loss of `loss`."""
    return f"dpo_{loss}"


def completion_datum(prompt: Sequence[int], completion: Sequence[int]) -> Datum:
    """Prompt and completion as one sequence; weights 1 on the completion's targets."""
    tokens = [*prompt, *completion]
    weights_T = torch.zeros(len(tokens) - 1)
    weights_T[len(prompt) - 1 :] = 1.0
    return Datum(
        ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights_T}
    )


def pair_datums(pair: PreferencePair) -> tuple[Datum, Datum]:
    """(chosen, rejected) datums of one pair."""
    return completion_datum(pair.prompt, pair.chosen), completion_datum(pair.prompt, pair.rejected)


def dpo_batches(pairs: Sequence[PreferencePair], config: DPOConfig) -> list[list[int]]:
    """Pair indices of each update: shuffled (seeded) batches of `batch_size`, every epoch.

    Checks the pairs first, so bad input fails before any update.
    """
    check_pairs(pairs)
    rng = random.Random(config.shuffle_seed)
    batches: list[list[int]] = []
    for _ in range(config.epochs):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        batches += [
            order[i : i + config.batch_size] for i in range(0, len(order), config.batch_size)
        ]
    return batches


async def reference_logprobs(
    client: TrainingClient,
    datums: list[Datum],
    config: DPOConfig,
    reference: ReferenceScorer | None = None,
) -> list[torch.Tensor]:
    """Each datum's target logprobs under the reference policy (see the module docstring);
    `reference="base"` scores with `reference` (a frozen base model) if given."""
    if config.reference == "initial":
        out = await client.forward(datums, "cross_entropy", LossConfig())
        return [o["logprobs"].reshape(-1).float().cpu() for o in out.loss_fn_outputs]
    if reference is not None:
        return [torch.tensor(r) for r in await reference.reference_logprobs(datums)]
    if not isinstance(client, ReferenceScorer):
        raise TypeError(
            f"reference='base' needs the base model's logprobs, which {type(client).__name__} "
            "cannot compute; pass reference='initial' (the policy at the start of the call)"
        )
    return [torch.tensor(r) for r in await client.reference_logprobs(datums)]


def with_dpo_inputs(
    datum: Datum, ref_logprobs_T: torch.Tensor, beta: float, pair_weight: float
) -> Datum:
    """The datum with its reference logprobs, and beta and its pair's weight at every position
    (a datum's inputs are per position)."""
    inputs = dict(datum.loss_fn_inputs)
    inputs["ref_logprobs"] = ref_logprobs_T
    inputs["dpo_beta"] = torch.full_like(ref_logprobs_T, beta)
    inputs["pair_weight"] = torch.full_like(ref_logprobs_T, pair_weight)
    return Datum(datum.model_input, inputs)


def update_datums(
    pairs: Sequence[tuple[Datum, Datum]],
    refs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    beta: float,
    pair_weight: float,
) -> list[Datum]:
    """One update's datums, chosen and rejected of each pair adjacent."""
    out: list[Datum] = []
    for (chosen, rejected), (ref_chosen, ref_rejected) in zip(pairs, refs, strict=True):
        out.append(with_dpo_inputs(chosen, ref_chosen, beta, pair_weight))
        out.append(with_dpo_inputs(rejected, ref_rejected, beta, pair_weight))
    return out


def dpo_loss_fn(loss: PairLoss) -> CustomLossFn:
    """The custom loss Σ_pairs pair_weight·ℓ_pair on datums from `update_datums`."""
    average = AVERAGES_TOKENS[loss]

    def fn(
        data: list[Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if len(data) % 2 or any(k not in d.loss_fn_inputs for d in data for k in REQUIRED):
            raise ValueError(
                f"{loss_name(loss)} takes (chosen, rejected) datum pairs with inputs "
                f"{', '.join(REQUIRED)}, as posttrain.trainer.dpo.update_datums makes them"
            )
        betas = {float(d.loss_fn_inputs["dpo_beta"].reshape(-1)[0]) for d in data}
        if len(betas) != 1:
            raise ValueError(f"{loss_name(loss)}: one forward_backward call has several betas")
        policy = [
            sequence_logp(lp.reshape(-1), d.loss_fn_inputs["weights"], average)
            for d, lp in zip(data, logprobs, strict=True)
        ]
        ref = [
            sequence_logp(d.loss_fn_inputs["ref_logprobs"], d.loss_fn_inputs["weights"], average)
            for d in data
        ]
        policy_P2, ref_P2 = torch.stack(policy).view(-1, 2), torch.stack(ref).view(-1, 2)
        out = pair_loss(
            policy_P2[:, 0], policy_P2[:, 1], ref_P2[:, 0], ref_P2[:, 1], betas.pop(), loss
        )
        weight_P = torch.stack([d.loss_fn_inputs["pair_weight"].reshape(-1)[0] for d in data[::2]])
        return (weight_P * out.loss_B).sum(), out.metric_sums()

    return fn


for _loss in get_args(PairLoss):  # named losses, for forward_backward_custom on any client
    register_loss(loss_name(_loss), dpo_loss_fn(_loss), pairs=True)


async def train_dpo(
    client: TrainingClient,
    pairs: Sequence[PreferencePair],
    config: DPOConfig,
    *,
    reference: Opener[ReferenceScorer | None] | None = None,
    run: RunUpdates = run_now,
) -> StepMetrics:
    """All of a `train_dpo` call: reference logprobs, then one update per batch of pairs.
    Bad input fails in `dpo_batches`, before the base reference (`reference`, opened for
    reference 'base'; None: the client's own) and before `run` runs the updates."""
    batches = dpo_batches(pairs, config)
    scorer = await reference() if reference is not None and config.reference == "base" else None
    return await run(lambda: train_dpo_batches(client, pairs, batches, config, scorer))


async def train_dpo_batches(
    client: TrainingClient,
    pairs: Sequence[PreferencePair],
    batches: Sequence[Sequence[int]],
    config: DPOConfig,
    reference: ReferenceScorer | None = None,
) -> StepMetrics:
    """The updates of `train_dpo` on batches from `dpo_batches` (already validated); the base
    reference scores with `reference` if given (a frozen base model), else the client."""
    if not isinstance(client, CustomLossClient):
        raise TypeError(f"DPO needs forward_backward_custom, which {type(client).__name__} lacks")
    datums = [pair_datums(p) for p in pairs]
    flat = [d for pair in datums for d in pair]
    ref = await reference_logprobs(client, flat, config, reference)  # before any update
    refs = list(zip(ref[::2], ref[1::2], strict=True))
    fn = custom_loss(loss_name(config.loss_fn))
    adam = config.optimizer.adam_params()
    metrics = StepMetrics(num_trajectories=len(flat))
    sums = dict.fromkeys(METRICS, 0.0)
    num_pairs = 0
    with Progress("train_dpo", len(batches), "update") as progress:
        for batch in batches:
            update = update_datums(
                [datums[i] for i in batch], [refs[i] for i in batch], config.beta, 1 / len(batch)
            )
            out = await client.forward_backward_custom(update, fn)
            step = await client.optim_step(adam)
            tokens = int(sum(float(d.loss_fn_inputs["weights"].sum()) for d in update))
            metrics.add_update(out.metrics, step.metrics or {}, num_tokens=tokens)
            for key in METRICS:
                sums[key] += out.metrics[key]
            num_pairs += len(batch)
            progress.update(loss=out.metrics["loss:sum"])
    metrics.flow = {key: total / num_pairs for key, total in sums.items()}
    metrics.flow["num_pairs"] = float(len(pairs))
    return metrics
