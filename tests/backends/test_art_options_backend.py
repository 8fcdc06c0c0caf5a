"""ART's options through LocalBackend.train(): the CISPO default with ART's clip range, verbose
step diagnostics, the refused learning-rate scaling, and a registered custom loss by name."""

from __future__ import annotations

import logging

import pytest
import torch

from local_groups import synthetic_groups, weights_of
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.clients import custom_loss as registry
from posttrain.clients.custom_loss import builtin_as_custom, register_loss
from posttrain.trainer.config import RLConfig, from_options


async def registered(tiny_model_dir, path):
    backend = LocalBackend(path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    return backend, model


async def trained(tiny_model_dir, path, **options) -> dict[str, torch.Tensor]:
    backend, model = await registered(tiny_model_dir, path)
    try:
        await backend.train(model, synthetic_groups(3), learning_rate=1e-2, **options)
        return weights_of(backend, model)
    finally:
        await backend.close()


async def test_no_loss_option_trains_as_cispo_with_arts_clip_range(tiny_model_dir, tmp_path):
    """An ART script that sets neither ppo nor loss runs CISPO with epsilon 1.0 / epsilon_high
    4.0, to the bit; and that is not what ppo=True does."""
    default = await trained(tiny_model_dir, tmp_path / "a")
    explicit = await trained(
        tiny_model_dir, tmp_path / "b", loss="cispo", epsilon=1.0, epsilon_high=4.0
    )
    for name, value in default.items():
        assert torch.equal(value, explicit[name]), name
    ppo = await trained(tiny_model_dir, tmp_path / "c", ppo=True)
    assert any(not torch.equal(value, ppo[name]) for name, value in default.items())


async def test_verbose_logs_each_update(tiny_model_dir, tmp_path, caplog):
    backend, model = await registered(tiny_model_dir, tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="posttrain.trainer.rl"):
            await backend.train(model, synthetic_groups(3), verbose=True, num_minibatches=2)
        lines = [r.getMessage() for r in caplog.records if r.name == "posttrain.trainer.rl"]
        assert [line.split(":")[0] for line in lines] == ["update 1/2", "update 2/2"]
        assert all("loss:sum=" in line and "tokens" in line for line in lines)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="posttrain.trainer.rl"):
            await backend.train(model, synthetic_groups(4))
        assert not [r for r in caplog.records if r.name == "posttrain.trainer.rl"]
    finally:
        await backend.close()


async def test_scaling_the_learning_rate_by_reward_std_dev_is_refused(tiny_model_dir, tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=8)
    with pytest.raises(ValueError, match="scale_learning_rate_by_reward_std_dev=True is invalid"):
        await backend.train(model, [], scale_learning_rate_by_reward_std_dev=True)
    assert from_options(RLConfig, {"scale_learning_rate_by_reward_std_dev": False})


async def test_a_registered_loss_plugs_into_train(tiny_model_dir, tmp_path, monkeypatch):
    """A custom loss equal to ppo (ART's range) trains as loss="ppo": one Adam step, whose
    update lr·g/(|g|+eps) amplifies fp32 noise only where |g| ~ eps, hence the 1e-6 cut on
    weights of size ~1e-1 (measured: equal)."""
    monkeypatch.setattr(registry, "_registered", {})
    config = from_options(RLConfig, {"loss": "ppo"})
    name = register_loss("hand_ppo", builtin_as_custom("ppo", config.loss_fn_config))
    by_name = await trained(tiny_model_dir, tmp_path / "a", loss=name)
    builtin = await trained(tiny_model_dir, tmp_path / "b", loss="ppo")
    for key, value in builtin.items():
        torch.testing.assert_close(by_name[key], value, rtol=0, atol=1e-6)
    with pytest.raises(Exception, match="has no effect on the custom loss 'hand_ppo'"):
        await trained(tiny_model_dir, tmp_path / "c", loss=name, epsilon=0.3)
