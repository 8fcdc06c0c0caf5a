"""RayBackend end to end on a tiny model: SFT and RL steps, checkpoint, resume, options.

The Ray run (2 actors, gloo, interrupted after step 2 and resumed), with full replicas and with
FSDP2, must land where one uninterrupted LocalBackend run does: the same shared trainer, exact
sum semantics and exact resume. Each step's TrainResult metrics (global token-weighted losses,
gradient norms, ...) must equal LocalBackend's on the same data.

Tolerance as in tests/clients/test_ray_client.py: only fp32 summation order differs (two
shards), measured below 1e-7 relative on the weights; we allow 2e-6. Metrics get the same
relative tolerance plus 1e-6 absolute, for values that sum terms of both signs to near zero
(a mean advantage or loss; their rounding scales with the terms, ~1).
"""

from __future__ import annotations

import json

import pytest
import torch

from local_groups import synthetic_groups
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.options import LocalRLOptions, option_names
from posttrain.backends.protocol import TrainableBackend
from posttrain.backends.ray import RayBackend, RayRLConfig, RayRLOptions
from posttrain.engine.ray.executor import RayConfig
from posttrain.trainer.config import option_fields
from posttrain.types import (
    SamplingParams,
    TrainResult,
)

REL_TOL = 2e-6
TEST_RAY = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a)
    den = sum(float(a[k].double().norm() ** 2) for k in a)
    return (num / den) ** 0.5


def ray_weights(backend: RayBackend, model: TrainableModel) -> dict[str, torch.Tensor]:
    """Rank 0's whole trainable weights (gathered under FSDP)."""
    return backend.client(model).executor.full_tensors("weights")[0]  # pyright: ignore[reportReturnType]


def local_weights(backend: LocalBackend, model: TrainableModel) -> dict[str, torch.Tensor]:
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    return {n: p.detach().clone() for n, p in worker.trainable_parameters().items()}


async def three_steps(
    backend: TrainableBackend, model: TrainableModel, stop_after: int | None
) -> dict[int, TrainResult]:
    """SFT (step 1), then RL steps 2 and 3; returns early once `stop_after` is reached."""
    results: dict[int, TrainResult] = {}
    while model.step < 3:
        if model.step == 0:
            trajectories = [t for g in synthetic_groups(0) for t in g.trajectories]
            result = await backend.train_sft(model, trajectories, batch_size=5, learning_rate=1e-3)
        else:
            result = await backend.train(model, synthetic_groups(model.step), learning_rate=1e-3)
        results[result.step] = result
        if model.step == stop_after:
            break
    return results


def assert_same_metrics(got: TrainResult, expected: TrainResult, rel: float = REL_TOL) -> None:
    assert got.step == expected.step
    assert got.metrics.keys() == expected.metrics.keys()
    for key, value in expected.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=rel, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicate", "fsdp2"])
async def test_train_checkpoint_resume_matches_local(
    ray_started, tiny_model_dir, tmp_path, sharding
):
    local = LocalBackend(tmp_path / "local")
    expected = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await expected.register(local)
    expected_results = await three_steps(local, expected, stop_after=None)

    first = RayBackend(tmp_path / "ray", num_workers=2, ray_config=TEST_RAY, sharding=sharding)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(first)
    results = await three_steps(first, model, stop_after=2)
    result = await first.train(
        model, synthetic_groups(9), save_checkpoint=False, check_weights_in_sync=True
    )
    assert result.step == 3 and result.checkpoint_path is None
    await first.close()  # "dies" after step 3's update, which was never checkpointed

    second = RayBackend(tmp_path / "ray", num_workers=2, ray_config=TEST_RAY, sharding=sharding)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(second)
    assert model.step == 2  # resumed from checkpoint 2, not a fresh start
    results |= await three_steps(second, model, stop_after=None)
    assert sorted(results) == [1, 2, 3]
    for step, result in results.items():
        assert_same_metrics(result, expected_results[step])
    assert sorted(p.name for p in (model.directory / "checkpoints").iterdir()) == [
        "1",
        "2",
        "3",
    ]
    state = json.loads((model.directory / "checkpoints" / "3" / "trainer_state.json").read_text())
    assert state["step"] == 3
    assert rel_error(local_weights(local, expected), ray_weights(second, model)) < REL_TOL
    await second.check_weights_in_sync(model)
    # Rollout code samples from the workers through the same ModelSampler.
    sampler = second.sampling_client(model)
    responses = await sampler.sample_many(
        [[5, 6, 7], [8, 9]], 2, SamplingParams(max_tokens=3, seed=0)
    )
    assert [len(r.sequences) for r in responses] == [2, 2]
    await second.close()
    await local.close()


@pytest.mark.slow
async def test_packed_sft_matches_local_unpacked(ray_started, tiny_model_dir, tmp_path):
    # Packing reaches every Ray rank (and, under FSDP2, each unpacked micro-batch packs into
    # one pass, so the ranks' collectives line up): same metrics and weights as LocalBackend
    # unpacked, to the tolerance of the module docstring. Both shardings in one Ray session,
    # which costs more to start than either run.
    trajectories = [t for g in synthetic_groups(0) for t in g.trajectories]
    local = LocalBackend(tmp_path / "local")
    expected = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await expected.register(local)
    plain = await local.train_sft(expected, trajectories, batch_size=5, learning_rate=1e-3)
    for sharding in ("replicate", "fsdp2"):
        ray = RayBackend(tmp_path / sharding, num_workers=2, ray_config=TEST_RAY, sharding=sharding)
        model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
        await model.register(ray)
        packed = await ray.train_sft(
            model, trajectories, batch_size=5, learning_rate=1e-3, packing=True
        )
        assert_same_metrics(packed, plain)
        assert rel_error(local_weights(local, expected), ray_weights(ray, model)) < REL_TOL, (
            sharding
        )
        await ray.close()
    await local.close()


def test_options_and_config_name_the_same_keys():
    assert option_names(RayRLOptions) == set(option_fields(RayRLConfig))
    assert option_names(RayRLOptions) == option_names(LocalRLOptions) | {"check_weights_in_sync"}


async def test_runtime_rejects_options_ray_backend_lacks(tmp_path):
    backend = RayBackend(tmp_path)  # starts nothing until a model registers
    model = TrainableModel(name="m", project="p", base_model="does-not-exist", lora_rank=8)
    with pytest.raises(
        TypeError, match=r"RayBackend.train\(\).*'check_weight_in_sync'.*did you mean"
    ):
        await backend.train(model, [], check_weight_in_sync=True)  # pyright: ignore[reportCallIssue]
    with pytest.raises(ValueError, match="check_weights_in_sync"):
        await backend.train(model, [], check_weights_in_sync="yes")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"RayBackend.train_sft\(\).*'kl_penalty_coef'"):
        await backend.train_sft(model, [], kl_penalty_coef=0.1)  # pyright: ignore[reportCallIssue]
    with pytest.raises(RuntimeError, match="not registered"):
        await backend.train(model, [], kl_penalty_coef=0.1, check_weights_in_sync=True)
    with pytest.raises(ValueError, match="num_workers"):
        RayBackend(tmp_path, num_workers=0)
