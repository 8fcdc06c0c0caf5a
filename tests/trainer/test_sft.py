"""The shared SFT routine: the learning rate of every update is engine.optim's schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from posttrain.clients.create import create_training_client
from posttrain.data.trajectories import TokenSegment, Trajectory
from posttrain.engine.executor import InProcessExecutor
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


def ragged(seed: int, length: int) -> Trajectory:
    tokens = [(seed * 7 + i * 13) % 250 + 3 for i in range(length)]
    prompt = max(1, length // 3)
    return Trajectory(
        (TokenSegment(tuple(tokens[:prompt])), TokenSegment(tuple(tokens[prompt:]), True)), 0.0
    )


async def test_packed_updates_equal_the_unpacked_ones(tiny_model_dir):
    # Lengths 4 to 90 tokens; two updates of 4. Packing changes only the sums' order: each
    # update's token-mean loss and the trained LoRA weights agree to fp32 rounding (measured
    # equal bit for bit here; the bound allows fp32 rounding), and the client stops packing after.
    trajectories = [ragged(i, n) for i, n in enumerate((4, 90, 12, 47, 6, 70, 9, 25))]
    config = from_options(SFTConfig, {"learning_rate": 1e-3, "batch_size": 4})
    runs = []
    for packing in (True, False):
        client = create_training_client(tiny_model_dir, lora_rank=4)
        losses: list[float] = []
        await train_sft(
            client,
            trajectories,
            replace(config, packing=packing),
            on_update=lambda i, m, losses=losses: losses.append(m["loss"]),
        )
        executor = client.dispatch.executor
        assert isinstance(executor, InProcessExecutor)
        assert not any(w.config.packing for w in executor.workers)
        runs.append((losses, client.trainable_weights().result()))
        client.close()
    (losses, weights), (losses_plain, weights_plain) = runs
    assert len(losses) == 2 and losses == pytest.approx(losses_plain, rel=1e-6)
    # Measured bit-identical. The bound allows the packed pass's fp32 summation order (loss
    # within 1e-6): Adam divides by sqrt(v), so a weight whose gradient is near zero can move
    # by more than its gradient's relative error. Masks and positions: tests/engine/test_packing.py.
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, weights_plain[name], rtol=1e-5, atol=1e-7)


async def test_packing_on_a_client_that_cannot_pack_is_refused():
    class WireClient:  # a Tinker-like client: the protocol's calls, no `set_packing`
        pass

    config = from_options(SFTConfig, {"packing": True})
    with pytest.raises(ValueError, match=r"packing=True\): WireClient cannot pack"):
        await train_sft(WireClient(), [trajectory(0)], config)  # pyright: ignore[reportArgumentType]
