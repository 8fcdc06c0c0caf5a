"""ART's remaining names: `art.Model`, a model that is not trained, sampled through an
OpenAI-compatible URL and logged beside the trained ones; and
`model.delete_checkpoints(best_checkpoint_metric)`, which keeps the latest and the best."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import posttrain as art
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.run_records import best_step


def groups(seed: int) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    prompt = TokenSegment(tuple(rng.randrange(3, 250) for _ in range(4)))
    out = []
    for reward in (0.0, 1.0):
        sampled = TokenSegment(
            tuple(rng.randrange(3, 250) for _ in range(3)),
            trainable=True,
            logprobs=(-5.0, -5.0, -5.0),
        )
        out.append(Trajectory((prompt, sampled), reward=reward))
    return [TrajectoryGroup(tuple(out))]


def test_the_best_step_is_the_highest_mean_of_the_metric_among_checkpointed_steps():
    history = [
        {"step": 1, "split": "val", "reward": 0.2},
        {"step": 2, "split": "val", "reward": 0.9},
        {"step": 2, "split": "val", "reward": 0.5},  # step 2's mean: 0.7
        {"step": 3, "split": "val", "reward": 0.7},  # a tie with step 2: the later wins
        {"step": 3, "split": "train", "reward": 5.0},  # another split
        {"step": 4, "split": "val", "reward": 0.95},  # no checkpoint any more
    ]
    assert best_step(history, "val/reward", [1, 2, 3]) == 3
    assert best_step(history, "val/reward", [1, 2]) == 2
    assert best_step(history, "train/reward", [1, 2, 3]) == 3
    with pytest.raises(ValueError, match=r"'val/accuracy'.*nothing was deleted.*'val/reward'"):
        best_step(history, "val/accuracy", [1, 2, 3])


async def test_delete_checkpoints_keeps_the_latest_and_the_best(tiny_model_dir: Path, tmp_path):
    backend = art.LocalBackend(tmp_path, keep_checkpoints=10)
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    for step, reward in enumerate([0.2, 0.9, 0.5, 0.1], start=1):
        result = await backend.train(model, groups(step), learning_rate=1e-3)
        assert result.step == step
        await model.log(split="val", metrics={"reward": reward}, step=step)
    checkpoints = model.directory / "checkpoints"
    with pytest.raises(ValueError, match="nothing was deleted"):
        await model.delete_checkpoints("val/accuracy")
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [1, 2, 3, 4]
    assert await model.delete_checkpoints() == [1, 3]  # ART's default metric, val/reward
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]
    await backend.close()
    again = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    backend = art.LocalBackend(tmp_path, keep_checkpoints=10)
    await again.register(backend)  # resumes from the latest, untouched
    assert again.step == 4
    await backend.close()


async def test_an_inference_only_model_samples_a_url_and_logs_beside_the_trained(
    tiny_model_dir: Path, tmp_path: Path
):
    """The 'server' here is a trained model's own endpoint; an art.Model only needs its URL."""
    backend = art.LocalBackend(tmp_path)
    served = art.TrainableModel(
        name="served", project="p", base_model=str(tiny_model_dir), lora_rank=8
    )
    await served.register(backend)
    endpoint = served.openai_endpoint()
    baseline = art.Model(
        name="baseline",
        project="p",
        inference_base_url=endpoint.base_url,
        inference_api_key=endpoint.api_key,
        inference_model_name=endpoint.model_name,
    )
    assert not baseline.trainable and await baseline.get_step() == 0
    assert baseline.get_inference_name() == "served"
    client = baseline.openai_client()
    assert baseline.openai_client() is client
    completion = await client.chat.completions.create(
        model=baseline.get_inference_name(),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        seed=0,
        extra_body={"return_token_ids": False},  # what a server without token ids answers
    )
    choice = completion.choices[0]
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, choice], reward=0.5
    )
    with pytest.raises(RuntimeError, match="not registered"):
        await baseline.log([art.TrajectoryGroup([trajectory])], split="val")
    await baseline.register(backend)
    row = await baseline.log([art.TrajectoryGroup([trajectory])], split="val")
    assert row["reward"] == 0.5
    directory = tmp_path / "p" / "models" / "baseline"
    assert baseline.history() == [{"step": 0, "split": "val", **row}]
    [line] = (directory / "trajectories" / "val" / "00000.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert "segments" not in record and record["messages"][-1]["role"] == "assistant"
    with pytest.raises(ValueError, match="inference_base_url and inference_api_key"):
        art.Model(name="judge", project="p").openai_client()
    with pytest.raises(ValueError, match=r"Model.name must be a plain name"):
        art.Model(name="a/b", project="p")
    await backend.close()


async def test_training_an_inference_only_model_says_it_is_not_trainable(tmp_path: Path):
    """An art.Model registers for its logs only: each call that trains or samples it says so,
    naming TrainableModel, rather than asking for the register it just had."""
    backend = art.LocalBackend(tmp_path)
    judge = art.Model(
        name="judge", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k"
    )
    await judge.register(backend)
    message = r"model 'judge' is a posttrain\.Model, .*not trainable.*posttrain\.TrainableModel\("
    calls = {
        "train": lambda: backend.train(judge, groups(0)),  # pyright: ignore[reportArgumentType]
        "train_sft": lambda: backend.train_sft(judge, []),  # pyright: ignore[reportArgumentType]
        "checkpoint": lambda: backend.checkpoint(judge),  # pyright: ignore[reportArgumentType]
    }
    for call in calls.values():
        with pytest.raises(TypeError, match=message):
            await call()
    with pytest.raises(TypeError, match=message):
        backend.sampling_client(judge)  # pyright: ignore[reportArgumentType]
    await backend.close()
