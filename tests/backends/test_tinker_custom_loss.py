"""TinkerBackend -> posttrain serve with what Tinker's loss_fn_config cannot carry: a sequence
importance_sampling_level and a registered custom loss (both through forward_backward_custom),
exact against LocalBackend; and deploy_checkpoint's TrainResult fields.

Tolerance as in test_tinker_backend.py's parity test (1e-5 relative on losses and on the LoRA
updates): the custom path computes the loss on the server's fp32 logprobs here, and the server
backpropagates −∂C/∂lp through cross_entropy, so only fp32 summation orders differ; a wrong
ratio level or a lost weight is off by orders of magnitude more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_openai_client import groups
from test_tinker_backend import (
    as_saved,
    lora_update,
    server_weights,
    tinker_backend,
    tiny,
)

from posttrain.backends.local import LocalBackend
from posttrain.clients import custom_loss as registry
from posttrain.clients.custom_loss import builtin_as_custom, register_loss
from posttrain.trainer.config import RLConfig, from_options

pytestmark = pytest.mark.slow
LR = 1e-2


async def _updates(server, tiny_model_dir: Path, tmp_path: Path, local: dict, remote: dict):
    """(losses, LoRA update) of three train() steps on each backend, from the same init."""
    local_backend = LocalBackend(tmp_path / "local")
    remote_backend = tinker_backend(server, tmp_path / "remote")
    models = [tiny("custom", tiny_model_dir, seed=5), tiny("custom", tiny_model_dir, seed=5)]
    await models[0].register(local_backend)
    await models[1].register(remote_backend)
    worker = local_backend.client(models[0]).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]

    def local_weights() -> dict[str, torch.Tensor]:
        return as_saved({n: p.detach().clone() for n, p in worker.trainable_parameters().items()})

    initial = local_weights()
    losses = []
    for backend, model, options in (
        (local_backend, models[0], local),
        (remote_backend, models[1], remote),
    ):
        steps = [
            await backend.train(
                model, groups(i), learning_rate=LR, save_checkpoint=False, **options
            )
            for i in range(3)
        ]
        losses.append([r.metrics["loss"] for r in steps])
    local_update = lora_update(local_weights(), initial)
    remote_update = lora_update(
        server_weights(server, await remote_backend.checkpoint(models[1])), initial
    )
    await local_backend.close()
    await remote_backend.close()
    return losses, float((remote_update - local_update).norm() / local_update.norm())


@pytest.mark.parametrize(
    "extra",
    [
        {"importance_sampling_level": "sequence"},
        {"importance_sampling_level": "geometric_average"},
        # A cap of 1 + 1e-3 bites on ratios this far from 1, as the mask and tau do.
        {
            "max_negative_advantage_importance_sampling_weight": 1.001,
            "mask_prob_ratio": True,
            "kimi_k2_tau": 0.1,
        },
    ],
)
async def test_options_on_the_logprobs_match_local_backend(server, tiny_model_dir, tmp_path, extra):
    options = {"loss": "ppo", **extra}
    losses, relative = await _updates(server, tiny_model_dir, tmp_path, options, options)
    print(f"{extra}: losses {losses}, relative update difference {relative:.2e}")
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert relative < 1e-5
    # The options matter: plain ppo locally gives other losses and another update.
    token, token_relative = await _updates(
        server, tiny_model_dir, tmp_path / "token", {"loss": "ppo"}, options
    )
    assert token[0] != pytest.approx(token[1], rel=1e-3)
    assert token_relative > 1e-3


async def test_a_registered_loss_runs_remotely_as_the_builtin_runs_locally(
    server,
    tiny_model_dir,
    tmp_path,
    monkeypatch,
):
    monkeypatch.setattr(registry, "_registered", {})
    config = from_options(RLConfig, {"loss": "cispo"})
    name = register_loss("hand_cispo", builtin_as_custom("cispo", config.loss_fn_config))
    losses, relative = await _updates(
        server, tiny_model_dir, tmp_path, {"loss": "cispo"}, {"loss": name}
    )
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert relative < 1e-5


async def test_deploy_checkpoint_publishes_the_steps_weights(server, tiny_model_dir, tmp_path):
    backend = tinker_backend(server, tmp_path)
    model = tiny("deploy", tiny_model_dir)
    await model.register(backend)
    plain = await backend.train(model, groups(0), learning_rate=LR, save_checkpoint=False)
    assert (plain.deployed, plain.artifact_name) == (False, None)
    deployed = await backend.train(
        model, groups(1), learning_rate=LR, save_checkpoint=False, deploy_checkpoint=True
    )
    assert deployed.deployed and deployed.step == 2
    assert deployed.artifact_name is not None and deployed.artifact_name.startswith("tinker://")
    assert "step_00002" in deployed.artifact_name
    model_id, kind, name = deployed.artifact_name.removeprefix("tinker://").split("/")
    assert kind == "sampler_weights"
    run_dir = server.storage / "runs" / model_id.replace(":", "_")
    published = load_file(run_dir / kind / name / "adapter_model.safetensors")
    published = {k: v for k, v in published.items() if "lora_" in k}
    current = server_weights(server, await backend.checkpoint(model))
    assert published.keys() == current.keys()
    assert all(torch.equal(published[k], current[k]) for k in current)  # the step's weights
    await backend.close()
