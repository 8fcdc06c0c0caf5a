"""LocalBackend end to end on a tiny model: steps, checkpoints, logs, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from local_groups import synthetic_groups, weights_of
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.preflight import PreflightError
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.load import load_hf_model
from posttrain.trainer.config import RLConfig, from_options


async def test_train_checkpoint_log_and_peft_loadable(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path, keep_checkpoints=2)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    assert model.step == 0
    for expected_step in (1, 2, 3):
        groups = synthetic_groups(expected_step)
        result = await backend.train(model, groups, learning_rate=1e-3)
        assert result.step == expected_step == model.step
        await model.log(groups, metrics=result.metrics, step=result.step)
    assert result.checkpoint_path is not None
    checkpoints = sorted(p.name for p in (model.directory / "checkpoints").iterdir())
    assert checkpoints == ["2", "3"]  # retention keeps the last 2
    history = model.history()
    assert [row["step"] for row in history] == [1, 2, 3]
    assert "loss" in history[-1] and "grad_norm" in history[-1] and "reward" in history[-1]
    assert (model.directory / "trajectories" / "train" / "00003.jsonl").exists()
    # The adapter loads with plain peft and gives the worker's logits.
    peft_model = PeftModel.from_pretrained(load_hf_model(tiny_model_dir), result.checkpoint_path)
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = worker.model(input_ids=ids).logits
        got = peft_model(input_ids=ids).logits
    # Same weights and the same kernels: only summation order may differ (fp32).
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    await backend.close()


async def test_resume_after_a_kill_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    async def run(path, stop_after: int | None):
        backend = LocalBackend(path)
        model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
        await model.register(backend)
        while model.step < 3:
            await backend.train(model, synthetic_groups(model.step), learning_rate=1e-3)
            if stop_after is not None and model.step == stop_after:
                await backend.close()  # the process "dies" here
                return None
        weights = weights_of(backend, model)
        await backend.close()
        return weights

    uninterrupted = await run(tmp_path / "a", None)
    assert await run(tmp_path / "b", stop_after=1) is None
    resumed = await run(tmp_path / "b", None)
    assert uninterrupted is not None and resumed is not None
    for name, value in uninterrupted.items():
        assert torch.equal(value, resumed[name]), name


async def test_sft_then_rl_on_a_full_model(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="full", project="p", base_model=str(tiny_model_dir), lora_rank=None)
    await model.register(backend)
    trajectories = [t for g in synthetic_groups(0) for t in g.trajectories]
    sft = await backend.train_sft(model, trajectories, batch_size=4, epochs=2, learning_rate=1e-3)
    assert sft.step == 1 and sft.metrics["num_updates"] == 6  # 12 trajectories / 4 x 2 epochs
    rl = await backend.train(model, synthetic_groups(1), learning_rate=1e-4, loss="cispo")
    assert rl.step == 2 and rl.metrics["num_updates"] == 1
    saved = json.loads((model.directory / "checkpoints" / "2" / "trainer_state.json").read_text())
    assert saved["step"] == 2
    await backend.close()


async def test_nothing_trainable_still_advances_the_step(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    groups = synthetic_groups(0)
    same = [
        TrajectoryGroup(tuple(Trajectory(t.segments, 1.0) for t in g.trajectories)) for g in groups
    ]
    result = await backend.train(model, same, save_checkpoint=False)
    assert result.step == 1 and result.checkpoint_path is None
    assert result.metrics["nothing_to_train"] == 1.0
    assert result.metrics["num_dropped_groups"] == 3.0
    await backend.close()


async def test_bad_input_gives_clear_errors(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    with pytest.raises(RuntimeError, match="not registered"):
        await backend.train(model, synthetic_groups(0))
    missing = TrainableModel(name="x", project="p", base_model=str(tmp_path / "nope"), lora_rank=8)
    with pytest.raises(FileNotFoundError, match="nope"):
        await missing.register(backend)
    await model.register(backend)
    with pytest.raises(ValueError, match="empty list of trajectory groups"):
        await backend.train(model, [])
    no_logprobs = TrajectoryGroup(
        (
            Trajectory((TokenSegment((5, 6)), TokenSegment((7, 8), trainable=True)), 1.0),
            Trajectory((TokenSegment((5, 6)), TokenSegment((9,), trainable=True)), 0.0),
        )
    )
    with pytest.raises(ValueError, match="allow_training_without_logprobs"):
        await backend.train(model, [no_logprobs])
    assert model.step == 0 and not (model.directory / "checkpoints").exists()
    result = await backend.train(model, [no_logprobs], allow_training_without_logprobs=True)
    assert result.step == 1
    with pytest.raises(ValueError, match="reward"):
        Trajectory((TokenSegment((1, 2)),), reward=float("nan"))
    # Preflight runs before any work: the step and the checkpoints stay as they were.
    with pytest.raises(
        PreflightError, match="truncated_importance_sampling: needs precalculate_logprobs"
    ):
        await backend.train(model, synthetic_groups(0), truncated_importance_sampling=2.0)
    assert model.step == 1
    result = await backend.train(model, synthetic_groups(0), logprob_calculation_chunk_size=7)
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    assert worker.config.logprob_chunk_size == 7 and result.step == 2
    await backend.close()


def test_ppo_switch_picks_the_loss_and_refuses_a_conflict():
    # ART runs CISPO when a script sets neither ppo nor loss_fn.
    assert RLConfig().loss_fn == "cispo"
    assert from_options(RLConfig, dict(ppo=True)).loss_fn == "ppo"
    # ART: ppo=False is its CISPO default.
    assert from_options(RLConfig, dict(ppo=False)).loss_fn == "cispo"
    assert from_options(RLConfig, dict(loss="dro")).loss_fn == "dro"
    assert from_options(RLConfig, dict(loss="cispo", ppo=False)).loss_fn == "cispo"
    with pytest.raises(ValueError, match=r"loss='ppo' and ppo=False disagree"):
        from_options(RLConfig, dict(loss="ppo", ppo=False))


async def test_ppo_false_trains_exactly_as_cispo(tiny_model_dir, tmp_path):
    """ART's `ppo=False` is loss='cispo' to the bit, and differs from `ppo=True`."""

    async def trained(options: dict, name: str) -> dict[str, torch.Tensor]:
        backend = LocalBackend(tmp_path / name)
        model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
        await model.register(backend)
        for step in (1, 2):
            await backend.train(
                model, synthetic_groups(step), learning_rate=1e-2, save_checkpoint=False, **options
            )
        weights = weights_of(backend, model)
        await backend.close()
        return weights

    switch = await trained({"ppo": False}, "switch")
    cispo = await trained({"loss": "cispo"}, "cispo")
    ppo = await trained({"ppo": True}, "ppo")
    assert all(torch.equal(switch[n], cispo[n]) for n in cispo)
    assert any(not torch.equal(switch[n], ppo[n]) for n in ppo)
