"""The parity check against engines that do not serve the trained policy.

`FaultyEngine` (`inference.faults`) wraps the split pytorch engine (a real engine in a worker process) and claims
every version it is given while it serves another: the base model (it never applies an
update), the previous snapshot (one sync behind), or all but one snapshot (one sync dropped).

Why "first detectable step" is the step each test names: the model is a fresh LoRA (B = 0),
so at model step 0 the base model IS the policy, and an engine that never syncs, or syncs one
version late, still serves the right weights for step 1's rollouts. The first wrong sync is
that of version 1 (base / previous) or of the dropped version k; the rollouts sampled after it
are trained at step 2 (k + 1), whose check comes before its first update.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import posttrain
from posttrain.data.trajectories import POLICY_VERSION, TrajectoryGroup
from posttrain.inference.faults import Fault, FaultyEngine
from posttrain.trainer.parity import ParityError
from posttrain.types import AdamParams, SamplingParams

PARAMS = SamplingParams(max_tokens=6, seed=11, stop=[])


async def _registered(tmp_path: Path, tiny_model_dir: Path, fault: Fault, **inference):
    backend = posttrain.LocalBackend(
        tmp_path, inference={"devices": "cpu,cpu", "threads": 1, **inference}
    )
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4, seed=0
    )
    await model.register(backend)
    session = backend._models.record(model).engine
    session.engine = FaultyEngine(session.engine, fault)
    return backend, model


async def _step(backend, model, *, stamp: int | None = None, **options):
    """One RL step on 4 fresh samples of one prompt, each trajectory stamped with the version
    the engine claimed (or with `stamp`)."""
    return await _train(backend, model, await _rollouts(backend, model, stamp), **options)


async def _train(backend, model, group: TrajectoryGroup, **options):
    return await backend.train(model, [group], learning_rate=5e-2, **options)


async def _rollouts(backend, model, stamp: int | None = None) -> TrajectoryGroup:
    sampler = backend.sampling_client(model)
    builder = posttrain.TrajectoryBuilder(sampler.tokenizer)
    prompt = builder.prompt({"role": "user", "content": "abc"})
    response = (await sampler.sample_many([prompt], 4, PARAMS))[0]
    version = response.policy_version if stamp is None else stamp
    group = []
    for i, sequence in enumerate(response.sequences):
        turn = builder.fork()
        turn.completion(sequence)
        group.append(turn.build(reward=float(i), metadata={POLICY_VERSION: version}))
    return TrajectoryGroup(tuple(group))


async def _trainer_logprobs(backend, model) -> list[float | None]:
    return await backend.sampling_client(model).compute_logprobs([1, 2, 3, 4, 5, 6, 7, 8])


async def _no_gradients_left(backend, model) -> bool:
    """An optim_step with no accumulated gradient is skipped (and changes nothing)."""
    client = backend._models.record(model).client
    step = await client.optim_step(AdamParams(learning_rate=1e-3))
    return (step.metrics or {}).get("skipped:sum") == 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "caught_at", "options"),
    [
        # The ratio's reference from a forward first: the check reads it before any update.
        ("base", 2, {"precalculate_logprobs": True}),
        # Judged on the first mini-batch's forward_backward, before its optim_step; the
        # checkpoint reload drops that forward_backward's gradients.
        ("previous", 2, {}),
        # No checkpoint to reload: judged on a forward pass before the forward_backward.
        ("drop", 3, {"save_checkpoint": False}),
    ],
)
async def test_a_wrong_engine_fails_the_first_detectable_step_before_any_update(
    tiny_model_dir: Path, tmp_path: Path, fault: Fault, caught_at: int, options: dict
):
    backend, model = await _registered(tmp_path, tiny_model_dir, fault)
    try:
        for _ in range(1, caught_at):
            result = await _step(backend, model, **options)
            assert result.metrics["logprob_diff_mean"] < 1e-5  # fp32: a correct step
        before = await _trainer_logprobs(backend, model)
        checkpoints = backend.checkpoint_steps(model)
        with pytest.raises(ParityError) as caught:
            await _step(backend, model, **options)
        message = str(caught.value)
        assert "'pytorch' engine" in message
        assert f"claims policy version {caught_at - 1} (expected {caught_at - 1})" in message
        assert "float32 bound 0.0005" in message and "parity_check = 'warn'" in message
        assert model.step == caught_at - 1
        assert backend.checkpoint_steps(model) == checkpoints
        assert await _trainer_logprobs(backend, model) == before  # no update applied
        assert await _no_gradients_left(backend, model)
    finally:
        await backend.close()


@pytest.mark.slow
async def test_warn_logs_and_trains_on_and_off_says_nothing(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    for mode in ("warn", "off"):
        backend, model = await _registered(
            tmp_path / mode, tiny_model_dir, "base", parity_check=mode
        )
        try:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="posttrain"):
                await _step(backend, model)
                result = await _step(backend, model)
            assert model.step == 2
            warned = [r for r in caplog.records if "does not sample the trained" in r.message]
            assert len(warned) == (1 if mode == "warn" else 0)
            # The metric is there either way: the base model is far from step 1's policy.
            assert result.metrics["logprob_diff_mean"] > 5e-4
        finally:
            await backend.close()


@pytest.mark.slow
async def test_stale_rollouts_make_a_probe_after_the_sync_catch_it(
    tiny_model_dir: Path, tmp_path: Path
):
    """Async RL trains on rollouts of an older version: none is on-policy, so the engine is
    probed right after the step's sync; a failed probe undoes the step from its checkpoint."""
    backend, model = await _registered(tmp_path, tiny_model_dir, "base")
    try:
        await _step(backend, model)  # on-policy: judged on its data, no probe
        before = await _trainer_logprobs(backend, model)
        with pytest.raises(ParityError, match=r"claims policy version 2 \(expected 2\).*probe"):
            await _step(backend, model, stamp=0)  # one version stale
        assert model.step == 1
        assert backend.checkpoint_steps(model) == [1]
        assert await _trainer_logprobs(backend, model) == before  # reloaded
    finally:
        await backend.close()


@pytest.mark.slow
async def test_a_correct_engine_passes_stale_rollouts_through_its_probe(
    tiny_model_dir: Path, tmp_path: Path
):
    """As async RL does (one step ahead): step 1 trains on-policy rollouts, step k > 1 the
    rollouts sampled before step k - 1's update. Each step records the gap the check judged
    (`parity_logprob_diff_mean`): step 1's own tokens, then the probe's, as small as fp32 makes
    them; `logprob_diff_mean`, over the stale tokens, measures how far the policy has moved
    since they were sampled."""
    backend, model = await _registered(tmp_path, tiny_model_dir, "none")
    try:
        ahead = await _rollouts(backend, model)
        results = []
        for _ in range(3):
            rollouts, ahead = ahead, await _rollouts(backend, model)
            results.append(await _train(backend, model, rollouts))
        assert model.step == 3
        for result in results:
            # A correct fp32 engine: <= 2.5e-7 (docs/engines.md); the bound is 5e-4.
            assert result.metrics["parity_logprob_diff_mean"] < 1e-5
        for result in results[1:]:  # one version stale, after an update at lr 5e-2
            assert result.metrics["logprob_diff_mean"] > 5e-4
    finally:
        await backend.close()


def test_parity_check_is_validated():
    with pytest.raises(ValueError, match=r"parity_check must be one of \['error', 'warn', 'off'\]"):
        posttrain.InferenceConfig(parity_check="strict")  # pyright: ignore[reportArgumentType]
