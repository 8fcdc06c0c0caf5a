"""The sampler-vs-trainer metrics of an RL step, end to end on the tiny model: trajectories
sampled by the built-in sampler, trained by LocalBackend.

The sampler (fp32, incremental with a KV cache) and the trainer (fp32, one full-sequence pass)
compute the same logprobs up to fp32 rounding, ~1e-6 per token on this model; hence 1e-4 on
the largest difference and 1e-5 on the mean (v1) in every test below.
"""

from __future__ import annotations

import math

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.clients import custom_loss as registry
from posttrain.clients.custom_loss import builtin_as_custom, register_loss
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.trainer.config import RLConfig, from_options
from posttrain.types import SampledSequence, SamplingParams

PROMPT = [104, 101, 108, 108, 111, 32]  # "hello " in the tiny byte-level vocabulary
KEYS = {"kl_sample_train_v1", "kl_sample_train_v2", "logprob_diff_max"}


async def sampled(
    tiny_model_dir, path
) -> tuple[LocalBackend, TrainableModel, list[SampledSequence]]:
    """A registered model (LoRA) and 8 completions of 8 tokens from its own sampler."""
    backend = LocalBackend(path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    params = SamplingParams(max_tokens=8, seed=0, stop=[])
    response = await backend.sampling_client(model).sample(PROMPT, 8, params)
    assert all(s.logprobs is not None and len(s.tokens) == 8 for s in response.sequences)
    return backend, model, response.sequences


def groups_of(
    sequences: list[SampledSequence],
    shifts: list[float | None],
    lengths: list[int] | None = None,
) -> list[TrajectoryGroup]:
    """Two groups of 4 (rewards 0, 1, 0, 1, so none is dropped); completion k is cut to
    lengths[k] tokens and its sampler logprobs shifted by shifts[k] (None: no logprobs)."""
    trajectories = []
    for k, (seq, shift) in enumerate(zip(sequences, shifts, strict=True)):
        n = len(seq.tokens) if lengths is None else lengths[k]
        assert seq.logprobs is not None
        logprobs = None if shift is None else tuple(lp + shift for lp in seq.logprobs[:n])
        completion = TokenSegment(tuple(seq.tokens[:n]), trainable=True, logprobs=logprobs)
        trajectories.append(Trajectory((TokenSegment(tuple(PROMPT)), completion), reward=k % 2))
    return [TrajectoryGroup(tuple(trajectories[:4])), TrajectoryGroup(tuple(trajectories[4:]))]


async def test_own_samples_agree_and_a_shift_by_c_gives_v1_c(tiny_model_dir, tmp_path):
    backend, model, sequences = await sampled(tiny_model_dir, tmp_path)
    try:
        same = await backend.train(model, groups_of(sequences, [0.0] * 8), learning_rate=0.0)
        assert same.metrics.keys() >= KEYS
        assert same.metrics["logprob_diff_max"] < 1e-4
        assert abs(same.metrics["kl_sample_train_v1"]) < 1e-5
        assert same.metrics["kl_sample_train_v2"] < 1e-8  # ½·δ² with |δ| < 1e-4

        c = 0.25
        shifted = await backend.train(model, groups_of(sequences, [c] * 8), learning_rate=0.0)
        # δ = (q + c) − p = c + O(1e-6): v1 = c, v2 = c²/2, max = c.
        assert shifted.metrics["kl_sample_train_v1"] == pytest.approx(c, abs=1e-5)
        assert shifted.metrics["kl_sample_train_v2"] == pytest.approx(c * c / 2, abs=1e-5)
        assert shifted.metrics["logprob_diff_max"] == pytest.approx(c, abs=1e-4)
    finally:
        await backend.close()


async def test_mini_batches_are_token_weighted_over_the_step(tiny_model_dir, tmp_path):
    backend, model, sequences = await sampled(tiny_model_dir, tmp_path)
    shifts = [0.1 * (k + 1) for k in range(8)]
    lengths = [2] * 4 + [5] * 4
    try:
        result = await backend.train(
            model,
            groups_of(sequences, list(shifts), lengths),
            learning_rate=0.0,  # no update between the two mini-batches: δ = shift exactly
            num_minibatches=2,
        )
    finally:
        await backend.close()
    # Mini-batch 1: 2·(0.1 + 0.2 + 0.3 + 0.4) = 2.0 over 8 tokens; mini-batch 2:
    # 5·(0.5 + 0.6 + 0.7 + 0.8) = 13.0 over 20 tokens. v1 = 15/28 = 0.5357, where a mean of
    # the mini-batches' means would give (0.25 + 0.65)/2 = 0.45.
    tokens = sum(lengths)
    v1 = sum(n * c for n, c in zip(lengths, shifts, strict=True)) / tokens
    v2 = sum(n * c * c / 2 for n, c in zip(lengths, shifts, strict=True)) / tokens
    assert result.metrics["num_updates"] == 2 and result.metrics["num_trainable_tokens"] == 28
    assert v1 == pytest.approx(15 / 28)
    assert result.metrics["kl_sample_train_v1"] == pytest.approx(v1, abs=1e-5)
    assert result.metrics["kl_sample_train_v2"] == pytest.approx(v2, abs=1e-5)
    assert result.metrics["logprob_diff_max"] == pytest.approx(0.8, abs=1e-4)


async def test_precalculated_logprobs_measure_before_any_update(tiny_model_dir, tmp_path):
    """With precalculate_logprobs every token is compared before the first update; without,
    the second mini-batch is compared after the first one's update, which moves it off c."""
    c = 0.25
    results = {}
    for precalculate in (True, False):
        backend, model, sequences = await sampled(tiny_model_dir, tmp_path / str(precalculate))
        try:
            results[precalculate] = await backend.train(
                model,
                groups_of(sequences, [c] * 8),
                learning_rate=5e-2,
                num_minibatches=2,
                precalculate_logprobs=precalculate,
            )
        finally:
            await backend.close()
    assert results[True].metrics["kl_sample_train_v1"] == pytest.approx(c, abs=1e-5)
    assert abs(results[False].metrics["kl_sample_train_v1"] - c) > 1e-3


@pytest.mark.parametrize("precalculate", [False, True])
async def test_tokens_without_sampler_logprobs_are_left_out(tiny_model_dir, tmp_path, precalculate):
    backend, model, sequences = await sampled(tiny_model_dir, tmp_path)
    options = {"allow_training_without_logprobs": True, "precalculate_logprobs": precalculate}
    try:
        # Odd completions have no logprobs; the even ones, shifted by 0.5, are all compared.
        half = groups_of(sequences, [0.5 if k % 2 == 0 else None for k in range(8)])
        result = await backend.train(model, half, learning_rate=0.0, **options)
        assert result.metrics["kl_sample_train_v1"] == pytest.approx(0.5, abs=1e-5)
        assert result.metrics["logprob_diff_max"] == pytest.approx(0.5, abs=1e-4)
        # No sampler logprob at all: nothing to compare, so no metric (not a NaN or a 0).
        none = await backend.train(model, groups_of(sequences, [None] * 8), **options)
        assert none.metrics["num_trainable_tokens"] == 64
        assert not KEYS & none.metrics.keys()
        assert all(not math.isnan(v) for v in none.metrics.values())
    finally:
        await backend.close()


async def test_a_custom_loss_reports_them_too(tiny_model_dir, tmp_path, monkeypatch):
    """forward_backward_custom returns the backward pass's logprobs, the same fp32 values."""
    monkeypatch.setattr(registry, "_registered", {})
    config = from_options(RLConfig, {"loss": "ppo"})
    name = register_loss("hand_ppo", builtin_as_custom("ppo", config.loss_fn_config))
    backend, model, sequences = await sampled(tiny_model_dir, tmp_path)
    try:
        result = await backend.train(model, groups_of(sequences, [0.25] * 8), loss=name)
    finally:
        await backend.close()
    assert result.metrics["kl_sample_train_v1"] == pytest.approx(0.25, abs=1e-5)
    assert result.metrics["logprob_diff_max"] == pytest.approx(0.25, abs=1e-4)
