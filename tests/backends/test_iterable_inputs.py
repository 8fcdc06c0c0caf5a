"""train() and train_sft() take any iterable, a generator included, and train on all of it.

A generator used to train nothing: the trainer read it twice (advantages, then datums), found
it empty the second time, and still advanced and checkpointed the step. The generator run
must equal the list run exactly: same process, same inputs, same arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from local_groups import synthetic_groups, weights_of
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.trainer.config import RLConfig, SFTConfig
from posttrain.trainer.rl import prepare_batch
from posttrain.trainer.sft import sft_batches


async def test_a_generator_trains_what_its_list_trains(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    results = {}
    for name in ("listed", "generated"):
        model = TrainableModel(name=name, project="p", base_model=str(tiny_model_dir), lora_rank=4)
        await model.register(backend)
        groups = synthetic_groups(1)
        given = groups if name == "listed" else (g for g in groups)
        rl = await backend.train(model, given, learning_rate=1e-3)
        trajectories = [t for g in synthetic_groups(2) for t in g.trajectories]
        given_sft = trajectories if name == "listed" else (t for t in trajectories)
        sft = await backend.train_sft(model, given_sft, learning_rate=1e-3, batch_size=4)
        results[name] = (rl, sft, weights_of(backend, model))
    (rl, sft, weights), (rl_gen, sft_gen, weights_gen) = results["listed"], results["generated"]
    assert rl.metrics["num_trajectories"] > 0  # the list run trains: the comparison means something
    assert rl_gen.metrics == rl.metrics and sft_gen.metrics == sft.metrics
    assert sft.metrics["num_trajectories"] == 12 and sft.metrics["num_updates"] == 3  # 12 / 4
    assert all(torch.equal(weights[k], weights_gen[k]) for k in weights)
    await backend.close()


async def test_what_is_not_an_iterable_of_groups_is_refused_before_any_work(
    tiny_model_dir, tmp_path
):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    group = synthetic_groups(0)[0]
    with pytest.raises(
        TypeError, match=r"LocalBackend.train\(\) takes an iterable.*TrajectoryGroup"
    ):
        await backend.train(model, group)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"item 0 is a Trajectory.*TrajectoryGroup\(\.\.\.\)"):
        await backend.train(model, list(group.trajectories))  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"train_sft\(\): item 1 is a TrajectoryGroup"):
        await backend.train_sft(model, [group.trajectories[0], group])  # pyright: ignore[reportArgumentType]
    assert model.step == 0 and not (model.directory / "checkpoints").exists()
    await backend.close()


def test_the_trainer_refuses_a_one_shot_iterable():
    """Power users calling the trainer directly get an error, never an empty second read."""
    groups = synthetic_groups(0)
    with pytest.raises(TypeError, match=r"must be a sequence.*generator.*list"):
        prepare_batch((g for g in groups), RLConfig())  # pyright: ignore[reportArgumentType]
    trajectories = (t for g in groups for t in g.trajectories)
    with pytest.raises(TypeError, match="must be a sequence"):
        sft_batches(trajectories, SFTConfig())  # pyright: ignore[reportArgumentType]
