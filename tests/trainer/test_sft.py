"""The shared SFT routine: the learning rate of every update is engine.optim's schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from posttrain.clients.create import create_training_client
from posttrain.data.trajectories import TokenSegment, Trajectory
from posttrain.engine.optim import create_lr_schedule, lr_multiplier
from posttrain.trainer.config import SFTConfig, from_options
from posttrain.trainer.sft import sft_batches, train_sft


def trajectory(seed: int) -> Trajectory:
    tokens = [(seed * 7 + i) % 250 + 3 for i in range(6)]
    return Trajectory((TokenSegment(tuple(tokens[:3])), TokenSegment(tuple(tokens[3:]), True)), 0.0)


def schedule_rates(config: SFTConfig, total: int) -> list[float]:
    """engine.optim's LambdaLR over an optimizer at the peak rate, stepped once per update."""
    optimizer = torch.optim.SGD(
        [torch.nn.Parameter(torch.zeros(1))], lr=config.optimizer.learning_rate
    )
    schedule = create_lr_schedule(
        optimizer,
        warmup_steps=config.warmup_steps,
        total_steps=total,
        decay=config.lr_schedule,
        min_lr_ratio=config.min_lr_ratio,
    )
    rates = []
    for _ in range(total):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
async def test_each_update_uses_the_scheduled_learning_rate(tiny_model_dir, decay):
    config = from_options(SFTConfig, dict(
        learning_rate=1e-3, lr_schedule=decay, warmup_steps=3, batch_size=2, epochs=2,
        min_lr_ratio=0.0 if decay == "constant" else 0.2,
    ))  # fmt: skip
    trajectories = [trajectory(i) for i in range(5)]  # 3 batches an epoch: 6 updates
    client = create_training_client(tiny_model_dir, lora_rank=4)
    used: list[float] = []
    await train_sft(
        client, trajectories, config, on_update=lambda i, m: used.append(m["learning_rate"])
    )
    client.close()
    expected = schedule_rates(config, 6)
    assert used == pytest.approx(expected, rel=1e-12)  # lr * multiplier, rounded either way
    assert used[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-12)  # linear warm-up
    if decay != "constant":
        assert used[-1] < used[3]  # decays after the warm-up


def test_a_warmup_longer_than_the_call_is_refused_before_any_update():
    config = from_options(SFTConfig, {"warmup_steps": 4, "batch_size": 2})
    # 3 trajectories in batches of 2: ceil(3 / 2) = 2 updates, fewer than 4 warm-up steps.
    with pytest.raises(ValueError) as raised:
        sft_batches([trajectory(i) for i in range(3)], config)
    assert str(raised.value) == (
        "the learning-rate schedule does not fit this call's 2 updates (3 trajectories, "
        "batch_size=2, epochs=1): need 0 <= warmup_steps <= total_steps and total_steps >= 1, "
        "got warmup_steps=4, total_steps=2"
    )
    # The message past the colon is engine.optim's own: the check lives there alone.
    with pytest.raises(ValueError) as direct:
        lr_multiplier(0, warmup_steps=4, total_steps=2)
    assert str(raised.value).endswith(str(direct.value))
    sft_batches([trajectory(i) for i in range(3)], replace(config, warmup_steps=2))  # fits
