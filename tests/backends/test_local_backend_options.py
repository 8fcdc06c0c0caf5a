"""LocalBackend options end to end on the tiny model, each against a hand computation.

KL penalty, precalculated logprobs with truncated importance sampling, tensor plots,
mini-batches, SFT on the last assistant turn only, and the SFT learning-rate schedule.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from matplotlib.image import imread
from peft import PeftModel

from local_groups import synthetic_groups, weights_of
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.load import load_hf_model
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.rl import train_rl_step
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import AdamParams, Datum, ModelInput


async def registered(tiny_model_dir, path, lora_rank: int | None = 4):
    backend = LocalBackend(path)
    model = TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=lora_rank
    )
    await model.register(backend)
    return backend, model


def varying(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The groups whose rewards differ (the others are dropped by default)."""
    return [g for g in groups if len(set(g.rewards)) > 1]


def target_logprobs(model: torch.nn.Module, trajectory: Trajectory) -> torch.Tensor:
    """log p(t_{i+1} | t_0..t_i) for every position, in float64."""
    ids = torch.tensor([trajectory.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].double(), dim=-1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0]


def trainable_mask(trajectory: Trajectory) -> torch.Tensor:
    return torch.tensor(
        [s.trainable for s in trajectory.segments for _ in s.tokens][1:], dtype=torch.bool
    )


async def test_kl_penalty_is_zero_before_an_update_then_matches_a_hand_k3(tiny_model_dir, tmp_path):
    backend, model = await registered(tiny_model_dir, tmp_path)
    first = await backend.train(model, synthetic_groups(0), learning_rate=2e-2, kl_penalty_coef=0.5)
    # LoRA's B matrices start at zero: the policy is the base model exactly, so is every k3.
    assert first.metrics["kl"] == 0.0
    groups = synthetic_groups(1)
    second = await backend.train(model, groups, learning_rate=2e-2, kl_penalty_coef=0.5)
    # By hand: step 2's forward runs on the weights of checkpoint 1; the reference is the base
    # model. k3 = e^(ref - lp) - (ref - lp) - 1, averaged over the trainable tokens.
    policy = PeftModel.from_pretrained(
        load_hf_model(tiny_model_dir), str(model.directory / "checkpoints" / "1")
    ).double()
    base = load_hf_model(tiny_model_dir).double()
    k3 = []
    for trajectory in (t for g in varying(groups) for t in g.trajectories):
        mask = trainable_mask(trajectory)
        delta = (target_logprobs(base, trajectory) - target_logprobs(policy, trajectory))[mask]
        k3.append(torch.exp(delta) - delta - 1)
    hand = float(torch.cat(k3).mean())
    assert hand > 1e-4  # the update moved the policy away from the base model
    # The backend's fp32 logprobs differ from these float64 ones by ~1e-6 per token; k3's
    # error is about |delta| times that, relative error ~1e-5 here.
    assert second.metrics["kl"] == pytest.approx(hand, rel=1e-4)
    await backend.close()


async def test_precalculated_logprobs_give_ratio_one_and_the_tis_weighted_loss(
    tiny_model_dir, tmp_path
):
    backend, model = await registered(tiny_model_dir, tmp_path)
    groups = synthetic_groups(3)
    options = {"loss": "importance_sampling", "learning_rate": 1e-3}
    plain = from_options(RLConfig, options)
    precalc = from_options(
        RLConfig, {**options, "precalculate_logprobs": True, "truncated_importance_sampling": 2.0}
    )
    client = backend.client(model)
    # Without precalculation the ratio is against the (synthetic) sampler logprobs: far from 1.
    assert (await train_rl_step(client, groups, plain)).as_dict()["ratio"] != pytest.approx(1.0)
    recorder = TensorRecorder()
    metrics = (await train_rl_step(client, groups, precalc, recorder=recorder)).as_dict()
    # On the first (only) mini-batch the reference is the same weights: ratio exactly 1.
    ratio = torch.cat(recorder.rows["ratio"])
    mask = torch.cat(
        [m for m in (trainable_mask(t) for g in varying(groups) for t in g.trajectories)]
    )
    assert bool((ratio[mask] == 1.0).all()) and metrics["ratio"] == 1.0
    # The loss by hand: -(1/N) Σ_t A_t · min(e^(old_t - sampler_t), 2), with old = the
    # trainer's logprobs (recorded) and N the step's trainable tokens (token mean).
    learner = torch.cat(recorder.rows["logprobs"]).double()[mask]
    advantages = torch.cat(recorder.rows["advantages"]).double()[mask]
    sampler = torch.tensor(
        [lp for g in varying(groups) for t in g.trajectories for lp in t.segments[1].logprobs],  # pyright: ignore[reportOptionalIterable]
        dtype=torch.float64,
    )
    tis = torch.exp(learner - sampler).clamp(max=2.0)
    hand = float(-(advantages * tis).sum() / mask.sum())
    assert metrics["loss"] == pytest.approx(hand, rel=1e-5, abs=1e-7)  # fp32 sums of ~30 terms
    await backend.close()


async def test_plot_tensors_writes_a_png(tiny_model_dir, tmp_path):
    backend, model = await registered(tiny_model_dir, tmp_path)
    await backend.train(model, synthetic_groups(0), plot_tensors=True)
    path = model.directory / "plots" / "step_00001.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)  # decodes the whole file
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300
    await backend.close()


def hand_minibatch(groups: list[TrajectoryGroup]) -> list[Datum]:
    """Datums written out by hand: GRPO advantages (r - mean) / (population std + 1e-6) on
    every sampled token, weights 1 / (trainable tokens of this mini-batch)."""
    pairs = []
    for group in groups:
        rewards = torch.tensor(group.rewards, dtype=torch.float64)
        adv = (rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-6)
        pairs += list(zip(group.trajectories, adv.tolist(), strict=True))
    return pairs_to_datums(pairs)


def pairs_to_datums(pairs: list[tuple[Trajectory, float]]) -> list[Datum]:
    total = sum(t.num_trainable_tokens for t, _ in pairs)
    datums = []
    for trajectory, adv in pairs:
        mask = trainable_mask(trajectory).float()
        logprobs = [lp for s in trajectory.segments for lp in (s.logprobs or [0.0] * len(s.tokens))]
        datums.append(
            Datum(
                ModelInput.from_ints(trajectory.tokens[:-1]),
                {
                    "target_tokens": trajectory.tokens[1:],
                    "logprobs": torch.tensor(logprobs[1:]) * mask,
                    "advantages": mask * adv,
                    "mask": mask,
                    "weights": mask / total,
                },
            )
        )
    return datums


async def test_minibatches_equal_the_same_updates_made_by_hand(tiny_model_dir, tmp_path):
    groups = varying(synthetic_groups(5, groups=8))[:4]
    assert len(groups) == 4  # every group trains, so the split is 2 groups per mini-batch
    backend, model = await registered(tiny_model_dir, tmp_path / "a")
    result = await backend.train(model, groups, learning_rate=1e-2, num_minibatches=2, loss="ppo")
    assert result.metrics["num_updates"] == 2
    by_backend = weights_of(backend, model)
    await backend.close()

    backend, model = await registered(tiny_model_dir, tmp_path / "b")
    client = backend.client(model)
    adam = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
    losses = []
    for half in (groups[:2], groups[2:]):  # 8 trajectories each: the contiguous halves
        out = await client.forward_backward(hand_minibatch(half), "ppo", {})
        losses.append(out.metrics["loss:sum"])
        await client.optim_step(adam)
    by_hand = weights_of(backend, model)
    for name, value in by_backend.items():
        # Same datums to the last bit, same kernels: the same weights exactly.
        assert torch.equal(by_hand[name], value), name
    assert result.metrics["loss"] == pytest.approx(statistics.fmean(losses), rel=1e-12)
    await backend.close()


def two_turns(seed: int) -> Trajectory:
    """context, a trainable turn, context, a trainable turn (tokens from `seed`)."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in torch.randint(3, 250, (n,), generator=g))

    return Trajectory(
        (
            TokenSegment(tokens(4)),
            TokenSegment(tokens(3), trainable=True),
            TokenSegment(tokens(2)),
            TokenSegment(tokens(5), trainable=True),
        ),
        reward=0.0,
    )


async def test_sft_last_turn_trains_exactly_the_last_assistant_turn(tiny_model_dir, tmp_path):
    trajectories = [two_turns(seed) for seed in range(6)]
    # The same conversations with the first turn made context by hand.
    last_only = [
        Trajectory((t.segments[0], TokenSegment(t.segments[1].tokens), *t.segments[2:]), 0.0)
        for t in trajectories
    ]
    options = {"batch_size": 3, "learning_rate": 1e-2}
    results, weights = [], []
    for name, data, turns in (
        ("a", trajectories, "last"),
        ("b", last_only, "all"),
        ("c", trajectories, "all"),
    ):
        backend, model = await registered(tiny_model_dir, tmp_path / name)
        results.append(await backend.train_sft(model, data, assistant_turns=turns, **options))  # pyright: ignore[reportArgumentType]
        weights.append(weights_of(backend, model))
        await backend.close()
    assert results[0].metrics["num_trainable_tokens"] == 6 * 5  # 5 tokens in each last turn
    assert results[2].metrics["num_trainable_tokens"] == 6 * (3 + 5)
    for name, value in weights[0].items():
        assert torch.equal(weights[1][name], value), name
    assert any(not torch.equal(weights[2][n], v) for n, v in weights[0].items())  # "all" differs
    assert results[0].metrics["loss"] == results[1].metrics["loss"]


async def test_sft_learning_rate_follows_the_schedule(tiny_model_dir, tmp_path):
    backend, model = await registered(tiny_model_dir, tmp_path)
    trajectories = [two_turns(seed) for seed in range(12)]
    result = await backend.train_sft(
        model,
        trajectories,
        learning_rate=1e-3,
        batch_size=2,
        warmup_steps=2,
        lr_schedule="cosine",
        min_lr_ratio=0.1,
    )
    # 6 updates; warm-up (i+1)/2 then 0.1 + 0.9 (1 + cos(pi p)) / 2 with p = (i - 2) / 4:
    # 5e-4, 1e-3, 1e-3, 8.68198e-4, 5.5e-4, 2.31802e-4 (peak 1e-3).
    hand = [5e-4, 1e-3, 1e-3, 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))), 5.5e-4]
    hand.append(1e-3 * (0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))))
    assert result.metrics["num_updates"] == 6
    assert result.metrics["learning_rate"] == pytest.approx(statistics.fmean(hand), rel=1e-12)
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    assert worker.optimizer.param_groups[0]["lr"] == pytest.approx(hand[-1], rel=1e-12)
    await backend.close()
