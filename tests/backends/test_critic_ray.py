"""A critic on RayBackend: a second actor group, FSDP2-sharded like the policy's, landing where
LocalBackend's critic does. Tolerance as in test_ray_backend.py (fp32 summation order across
two shards: measured below 1e-7 relative on the weights; 2e-6 allowed)."""

from __future__ import annotations

import pytest
from test_critic_backend import GAE, new_model, weights
from test_ray_backend import REL_TOL, TEST_RAY, assert_same_metrics, rel_error

from local_groups import synthetic_groups
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.ray import RayBackend

# The first step differs from LocalBackend's only in the order FSDP2 sums the ranks' gradients:
# REL_TOL. Later steps start from weights that AdamW's first update set to w - lr * sign(g) per
# element (its bias-corrected m / sqrt(v) is g / |g|), so an element whose gradient sums to
# within rounding of zero moves by +-lr depending on that order: a last-bit difference becomes
# an lr-sized one. Measured on a 2-core AVX2 host: critic/grad_norm 3.1e-8 apart at step 1,
# 6.0e-7 at step 2 (20x), the critic's weights 3.3e-7; on an AVX-512 host the step-2 gap was
# 2.8e-6, past REL_TOL. 2e-5 bounds the amplified gap with room and still catches a wrong
# reduction (a doubled or a missing rank's gradient moves grad_norm by tens of percent).
AMPLIFIED_TOL = 2e-5


@pytest.mark.slow
async def test_fsdp2_critic_matches_local(ray_started, tiny_model_dir, tmp_path):
    local = LocalBackend(tmp_path / "local")
    expected = new_model(tiny_model_dir)
    await expected.register(local)
    expected_results = [
        await local.train(expected, synthetic_groups(s, groups=2, size=3), **GAE) for s in range(2)
    ]
    # Two groups of two actors (policy and critic) at half a CPU each: they fit in two CPUs.
    backend = RayBackend(
        tmp_path / "ray",
        num_workers=2,
        ray_config=TEST_RAY,
        sharding="fsdp2",
        resources_per_worker={"CPU": 0.5},
    )
    model = new_model(tiny_model_dir)
    await model.register(backend)
    for s, reference in enumerate(expected_results):
        result = await backend.train(model, synthetic_groups(s, groups=2, size=3), **GAE)
        assert_same_metrics(result, reference, rel=REL_TOL if s == 0 else AMPLIFIED_TOL)
    critic = backend.critic_client(model)
    assert critic is not None
    gathered = critic.executor.full_tensors("weights")[0]
    assert rel_error(weights(local.critic_client(expected)), gathered) < AMPLIFIED_TOL  # pyright: ignore[reportArgumentType]
    await backend.close()
    await local.close()


@pytest.mark.slow
async def test_fsdp2_frozen_reference_matches_local(ray_started, tiny_model_dir, tmp_path):
    """A fully fine-tuned policy's KL reference as a second FSDP2 actor group (each rank holds
    a shard of it, where the in-worker copy was whole on every rank)."""
    kl = {"learning_rate": 1e-3, "kl_penalty_coef": 0.5, "loss": "ppo"}
    local = LocalBackend(tmp_path / "local")
    expected = TrainableModel(name="f", project="p", base_model=str(tiny_model_dir), lora_rank=None)
    await expected.register(local)
    expected_results = [await local.train(expected, synthetic_groups(s), **kl) for s in range(2)]
    backend = RayBackend(
        tmp_path / "ray",
        num_workers=2,
        ray_config=TEST_RAY,
        sharding="fsdp2",
        resources_per_worker={"CPU": 0.5},
    )
    model = TrainableModel(name="f", project="p", base_model=str(tiny_model_dir), lora_rank=None)
    await model.register(backend)
    results = [
        await backend.train(model, synthetic_groups(s), **kl) for s in range(len(expected_results))
    ]
    for result, reference in zip(results, expected_results, strict=True):
        assert_same_metrics(result, reference)
    assert results[-1].metrics["kl"] > 0
    await backend.close()
    await local.close()
