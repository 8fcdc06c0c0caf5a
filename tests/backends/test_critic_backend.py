"""PPO with a learned critic on LocalBackend: the critic's lifecycle (made at the first 'gae'
step, checkpointed beside the policy, pruned with it, resumed exactly) and its refusals.

Exactness: a run interrupted after step 2 (and after an unsaved step 3) and resumed must give
the uninterrupted run's step-3 metrics, policy weights and critic weights bit for bit: the same
process, the same data and the same operations in the same order leave no rounding to differ.
"""

from __future__ import annotations

import pytest
import torch

from local_groups import synthetic_groups
from posttrain.backends.capabilities import LOCAL
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.preflight import PreflightError, preflight_rl
from posttrain.backends.tinker import TINKER
from posttrain.clients.local import LocalTrainingClient
from posttrain.trainer.config import RLConfig, from_options
from posttrain.types import TrainResult

GAE = {
    "advantage_estimator": "gae",
    "loss": "ppo",
    "learning_rate": 1e-3,
    "critic_learning_rate": 1e-2,
    "gae_lambda": 0.95,
    "num_minibatches": 2,
    "update_epochs": 2,
}


def weights(client: LocalTrainingClient | None) -> dict[str, torch.Tensor]:
    assert client is not None
    worker = client.dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    return {n: p.detach().clone() for n, p in worker.trainable_parameters().items()}


async def gae_step(backend: LocalBackend, model: TrainableModel, **extra: object) -> TrainResult:
    groups = synthetic_groups(model.step, groups=2, size=3)
    return await backend.train(model, groups, **GAE, **extra)  # pyright: ignore[reportArgumentType]


def new_model(tiny_model_dir) -> TrainableModel:
    return TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)


async def test_a_critic_trains_checkpoints_and_resumes_exactly(tiny_model_dir, tmp_path):
    whole = LocalBackend(tmp_path / "whole", keep_checkpoints=2)
    model = new_model(tiny_model_dir)
    await model.register(whole)
    assert whole.critic_client(model) is None  # no critic before the first 'gae' step
    expected = [await gae_step(whole, model) for _ in range(3)]
    metrics = expected[0].metrics
    for key in ("critic/value_loss", "critic/values", "critic/returns", "critic/grad_norm"):
        assert key in metrics, key
    assert metrics["num_updates"] == 4  # 2 mini-batches x 2 epochs
    # The critic learns: after three steps its values moved off the zero-initialised head.
    assert expected[2].metrics["critic/values"] != 0.0
    assert metrics["num_zero_variance_groups"] >= 0 and metrics["num_dropped_groups"] == 0
    # Saved beside the policy's checkpoints and pruned with them (keep 2).
    critic_dir = model.directory / "critic" / "checkpoints"
    assert sorted(p.name for p in critic_dir.iterdir()) == ["2", "3"]
    assert sorted(p.name for p in (model.directory / "checkpoints").iterdir()) == ["2", "3"]
    await whole.close()

    first = LocalBackend(tmp_path / "resumed", keep_checkpoints=2)
    model = new_model(tiny_model_dir)
    await model.register(first)
    got = [await gae_step(first, model) for _ in range(2)]
    await gae_step(first, model, save_checkpoint=False)  # step 3, never saved: then "dies"
    await first.close()

    second = LocalBackend(tmp_path / "resumed", keep_checkpoints=2)
    model = new_model(tiny_model_dir)
    await model.register(second)
    assert model.step == 2
    assert second.critic_client(model) is not None  # loaded with the step's checkpoint
    got.append(await gae_step(second, model))
    for result, reference in zip(got, expected, strict=True):
        assert result.step == reference.step
        assert result.metrics == reference.metrics
    reference_backend = LocalBackend(tmp_path / "whole", keep_checkpoints=2)
    reference = new_model(tiny_model_dir)
    await reference.register(reference_backend)
    for a, b in (
        (weights(second.client(model)), weights(reference_backend.client(reference))),
        (weights(second.critic_client(model)), weights(reference_backend.critic_client(reference))),
    ):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    await second.close()
    await reference_backend.close()


async def test_the_critic_is_the_base_model_with_a_trained_value_head(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = new_model(tiny_model_dir)
    await model.register(backend)
    await gae_step(backend, model)
    names = set(weights(backend.critic_client(model)))
    assert any("lora_A" in n for n in names)  # the decoder's adapters
    head = [n for n in names if "lm_head" in n]
    assert head and not any("lora" in n for n in head)  # the head trains whole
    head_weight = weights(backend.critic_client(model))[next(n for n in head if "weight" in n)]
    assert head_weight.shape[0] == 1 and head_weight.abs().sum() > 0
    # The policy keeps its own unembedding, untouched by the critic.
    assert not any("modules_to_save" in n for n in weights(backend.client(model)))
    await backend.close()


def test_backends_without_a_critic_refuse_gae_before_any_work():
    config = from_options(RLConfig, {"advantage_estimator": "gae"})
    with pytest.raises(PreflightError, match=r"advantage_estimator: 'gae' needs a learned critic"):
        preflight_rl("TinkerBackend", TINKER, config)
    preflight_rl("LocalBackend", LOCAL, config)  # the same config passes where there is one


async def test_critic_options_are_refused_where_there_is_no_critic(tmp_path):
    from posttrain.backends.tinker import TinkerBackend

    backend = TinkerBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model="Qwen/Qwen3-0.6B", lora_rank=8)
    with pytest.raises(TypeError, match="does not support: 'gae_lambda'"):
        await backend.train(model, [], gae_lambda=0.9)  # pyright: ignore[reportCallIssue]


async def test_checkpoint_saves_and_prunes_the_critic_too(tiny_model_dir, tmp_path):
    # The job runner's order: train without a checkpoint, log, then checkpoint().
    backend = LocalBackend(tmp_path, keep_checkpoints=1)
    model = new_model(tiny_model_dir)
    await model.register(backend)
    for _ in range(2):
        await gae_step(backend, model, save_checkpoint=False)
        await backend.checkpoint(model)
    assert [p.name for p in (model.directory / "checkpoints").iterdir()] == ["2"]
    assert [p.name for p in (model.directory / "critic" / "checkpoints").iterdir()] == ["2"]
    await backend.close()


async def test_a_failed_step_puts_the_critic_back(tiny_model_dir, tmp_path, monkeypatch):
    backend = LocalBackend(tmp_path)
    model = new_model(tiny_model_dir)
    await model.register(backend)
    await gae_step(backend, model)
    before = weights(backend.critic_client(model))

    async def broken_save(*args: object) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(backend._models.index, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        await gae_step(backend, model)  # updates both models, then fails to checkpoint
    assert model.step == 1
    after = weights(backend.critic_client(model))
    assert all(torch.equal(before[k], after[k]) for k in before)
    await backend.close()
