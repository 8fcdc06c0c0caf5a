"""OpenAI-client rollouts, ART's way, on LocalBackend, RayBackend and TinkerBackend ->
`posttrain serve`: the trajectories hold exactly the tokens and logprobs the sampler produced.

"Exactly" is checked by scoring each trajectory's tokens with the trainer (`forward` with the
cross-entropy loss, on the training client) and comparing every trainable token's logprob with
the one the endpoint returned. Only float32 summation order differs between the two (KV-cached
decoding in a batch of concurrent requests, left-padded, against one full forward pass):
measured below 2e-6 here; 1e-5 still fails on any real mismatch (a token at the wrong
position, another temperature or other weights move a logprob by more than 1e-2).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

import posttrain as art
from chat_model import ADD_CALL, ADD_TOOL
from posttrain.engine.ray.executor import RayConfig
from posttrain.types import Datum, ModelInput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_helpers import KEY, start_server  # pyright: ignore[reportMissingImports]

TOL = 1e-5
WORDS = ["abc", "hello", "reverse me", "x"]


async def forward_logprobs(
    backend: object, model: art.TrainableModel, tokens: list[int]
) -> list[float]:
    """The trainer's logprob of each token after the first (a forward pass, no update)."""
    datum = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = await backend.client(model).forward([datum], "cross_entropy")  # pyright: ignore[reportAttributeAccessIssue]
    return out.loss_fn_outputs[0]["logprobs"].tolist()


async def assert_exact(
    backend: object, model: art.TrainableModel, trajectory: art.Trajectory
) -> None:
    tokens = trajectory.tokens
    forced = await forward_logprobs(backend, model, tokens)
    position = 0
    for segment in trajectory.segments:
        if segment.trainable:
            assert segment.logprobs is not None
            # forced[i] scores tokens[i + 1].
            expected = forced[position - 1 : position - 1 + len(segment.tokens)]
            assert list(segment.logprobs) == pytest.approx(expected, abs=TOL)
        position += len(segment.tokens)


def letters(text: str | None) -> float:
    """A reward that differs within a group: the share of lowercase letters in the reply."""
    text = text or ""
    return sum(c.islower() for c in text) / max(len(text), 1)


async def rollout(model: art.TrainableModel, word: str) -> art.Trajectory:
    """An ART rollout, written with `art.` names only (as ART's examples are)."""
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": f"say {word}"}], reward=0.0
    )
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=trajectory.messages(), max_tokens=8
    )
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)  # pyright: ignore[reportOptionalMemberAccess]
    trajectory.reward = letters(choice.message.content)
    trajectory.metrics["length"] = len(choice.message.content or "")
    return trajectory


async def art_step(backend: object, model: art.TrainableModel) -> list[art.TrajectoryGroup]:
    """One ART-style step: gather groups of rollouts, train, log."""
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, w) for _ in range(4)) for w in WORDS[:2]),
        pbar_desc="gather",
        max_exceptions=0,
    )
    step = await model.get_step()
    result = await backend.train(model, groups, learning_rate=1e-3, save_checkpoint=False)  # pyright: ignore[reportAttributeAccessIssue]
    assert result.step == step + 1 == await model.get_step()
    await model.log(groups, metrics=result.metrics)
    return groups


async def test_art_rollout_loop_trains_on_exact_tokens_locally(
    tiny_model_dir: Path, tmp_path: Path
):
    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(
        name="agent", project="p", base_model=str(tiny_model_dir), lora_rank=4
    )
    await model.register(backend)
    assert model.get_inference_name() == model.get_inference_name(step=0) == "agent"
    with pytest.raises(ValueError, match="current step"):
        model.get_inference_name(step=3)
    # Scored before the step: the weights that sampled them.
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, w) for _ in range(3)) for w in WORDS], pbar_desc=None
    )
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    for trajectory in (t for g in groups for t in g):
        assert [s.trainable for s in trajectory.segments] == [False, True]
        await assert_exact(backend, model, trajectory)
    trained = await art_step(backend, model)
    assert await model.get_step() == 1
    row = model.history()[-1]
    # The step's metrics win over log's own count: trained trajectories, so a group whose four
    # rewards happen to be equal (no advantage) is left out of it.
    counted, flat = row["num_trajectories"], row["num_zero_variance_groups"]
    assert isinstance(counted, float) and isinstance(flat, float)
    assert counted + 4 * flat == 8.0
    assert "length" in row
    saved = (model.directory / "trajectories" / "train" / "00001.jsonl").read_text().splitlines()
    assert len(saved) == 8
    assert json.loads(saved[0])["messages"][-1]["role"] == "assistant"
    assert len(trained) == 2
    await backend.close()


async def test_n_samples_per_request_are_trajectories_of_their_own(
    tiny_model_dir: Path, tmp_path: Path
):
    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(
        name="agent", project="p", base_model=str(tiny_model_dir), lora_rank=4
    )
    await model.register(backend)
    client = model.openai_client()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    chat = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=6,
        n=4,
    )
    text = await client.completions.create(
        model=model.get_inference_name(), prompt="hello ", max_tokens=5, n=3
    )
    trajectories = [art.Trajectory(messages_and_choices=[*messages, c]) for c in chat.choices]
    trajectories += [art.Trajectory(messages_and_choices=[c]) for c in text.choices]
    assert len({tuple(t.tokens) for t in trajectories}) == 7  # unseeded: 7 different samples
    for trajectory, choice in zip(trajectories, [*chat.choices, *text.choices], strict=True):
        assert list(trajectory.segments[-1].tokens) == choice.model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
        await assert_exact(backend, model, trajectory)
    assert trajectories[0].messages()[-1] == {
        "role": "assistant",
        "content": chat.choices[0].message.content,
    }
    await backend.close()


@pytest.mark.slow  # fine-tunes the chat model first (a few seconds)
async def test_multi_turn_tool_call_trains_exactly_the_assistant_tokens(
    chat_model_dir: Path, tmp_path: Path
):
    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(
        name="tools", project="p", base_model=str(chat_model_dir), lora_rank=4
    )
    await model.register(backend)
    client = model.openai_client()
    name = model.get_inference_name()
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "add"}], tools=[ADD_TOOL]
    )
    first = await client.chat.completions.create(
        model=name,
        messages=trajectory.messages(),
        tools=[ADD_TOOL],
        temperature=0,
        max_tokens=80,
    )
    call = first.choices[0]
    assert call.finish_reason == "tool_calls" and call.message.tool_calls
    function = call.message.tool_calls[0].function  # pyright: ignore[reportAttributeAccessIssue]
    assert (function.name, json.loads(function.arguments)) == (
        ADD_CALL["name"],
        ADD_CALL["arguments"],
    )
    trajectory.messages_and_choices.append(call)  # pyright: ignore[reportOptionalMemberAccess]
    args = json.loads(function.arguments)
    result = {
        "role": "tool",
        "tool_call_id": call.message.tool_calls[0].id,
        "content": str(args["a"] + args["b"]),
    }
    trajectory.messages_and_choices.append(result)  # pyright: ignore[reportOptionalMemberAccess]
    second = await client.chat.completions.create(
        model=name,
        messages=trajectory.messages(),
        tools=[ADD_TOOL],
        temperature=0,
        max_tokens=20,
    )
    answer = second.choices[0]
    assert answer.message.content == "five" and answer.finish_reason == "stop"
    trajectory.messages_and_choices.append(answer)  # pyright: ignore[reportOptionalMemberAccess]
    trajectory.reward = 1.0

    # Exactly the two sampled replies are trainable; the prompt, the tool result and the
    # template's tokens between them are context.
    trainable = [list(s.tokens) for s in trajectory.segments if s.trainable]
    assert trainable == [call.model_extra["token_ids"], answer.model_extra["token_ids"]]  # pyright: ignore[reportOptionalSubscript]
    assert [s.trainable for s in trajectory.segments] == [False, True, False, True]
    tokenizer = backend.sampling_client(model).tokenizer
    between = tokenizer.decode(trajectory.segments[2].tokens)  # pyright: ignore[reportArgumentType]
    assert between == "<|im_start|>tool\n5<|eos|><|im_start|>assistant\n"
    assert second.model_extra is not None and answer.model_extra is not None
    assert (
        trajectory.tokens
        == second.model_extra["prompt_token_ids"] + answer.model_extra["token_ids"]
    )
    await assert_exact(backend, model, trajectory)
    # The tool call goes back to the server as the SDK gave it, with arguments as a string.
    assert trajectory.messages()[1]["tool_calls"][0]["function"]["name"] == "add"  # pyright: ignore[reportGeneralTypeIssues, reportTypedDictNotRequiredAccess, reportIndexIssue]
    await backend.close()


async def test_a_rollout_that_raises_among_many_is_dropped_and_counted(
    tiny_model_dir: Path, tmp_path: Path
):
    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(
        name="agent", project="p", base_model=str(tiny_model_dir), lora_rank=4
    )
    await model.register(backend)

    async def flaky(index: int) -> art.Trajectory:
        trajectory = await rollout(model, "abc")
        if index == 2:
            raise ConnectionError("the tool server went away")
        return trajectory

    def groups() -> list[art.TrajectoryGroup]:
        return [
            art.TrajectoryGroup(flaky(i) for i in range(4)),
            art.TrajectoryGroup(flaky(9) for _ in range(4)),
        ]

    with pytest.raises(ConnectionError, match="went away"):  # by default, nothing is tolerated
        await art.gather_trajectory_groups(groups(), pbar_desc=None)
    gathered = await art.gather_trajectory_groups(groups(), pbar_desc=None, max_exceptions=0.2)
    assert [len(g) for g in gathered] == [3, 4]
    assert [type(e).__name__ for e in gathered[0].exceptions] == ["ConnectionError"]
    result = await backend.train(model, gathered, learning_rate=1e-3, save_checkpoint=False)
    await model.log(gathered, metrics=result.metrics)
    assert model.history()[-1]["exceptions"] == 1.0
    await backend.close()


def test_a_response_without_token_ids_is_refused_naming_the_field():
    """What the `openai` SDK makes of a server that returns no token ids (OpenAI's own)."""
    response = ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "gpt",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hi"},
                    "logprobs": {
                        "content": [
                            {"token": "hi", "logprob": -0.1, "bytes": None, "top_logprobs": []}
                        ]
                    },
                }
            ],
        }
    )
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "q"}, response.choices[0]]
    )
    with pytest.raises(
        ValueError,
        match=r"messages_and_choices\[1\]\.token_ids is missing.*posttrain's endpoint.*vLLM",
    ):
        trajectory.segments  # noqa: B018


@pytest.mark.slow  # starts a local Ray and two actor workers
async def test_art_rollouts_on_ray_backend(ray_started, tiny_model_dir: Path, tmp_path: Path):
    config = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)
    backend = art.RayBackend(tmp_path, num_workers=2, ray_config=config)
    model = art.TrainableModel(
        name="agent", project="p", base_model=str(tiny_model_dir), lora_rank=4
    )
    await model.register(backend)
    before = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(model, w) for _ in range(2)) for w in WORDS[:2]],
        pbar_desc=None,
    )
    for trajectory in (t for g in before for t in g):
        await assert_exact(backend, model, trajectory)
    await art_step(backend, model)
    after = await rollout(model, "abc")  # served from the trained weights
    await assert_exact(backend, model, after)
    await backend.close()


@pytest.mark.slow  # a `posttrain serve` subprocess
async def test_art_rollouts_on_tinker_backend_against_posttrain_serve(
    tiny_model_dir: Path, tmp_path: Path
):
    pytest.importorskip("tinker")
    server = start_server(tiny_model_dir, tmp_path / "storage")
    try:
        backend = art.TinkerBackend(tmp_path / "runs", base_url=server.url, api_key=KEY)
        model = art.TrainableModel(
            name="agent", project="p", base_model=str(tiny_model_dir), lora_rank=4
        )
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, w) for _ in range(2)) for w in WORDS[:2]],
            pbar_desc=None,
        )
        for trajectory in (t for g in groups for t in g):
            await assert_exact(backend, model, trajectory)
        await art_step(backend, model)
        await assert_exact(backend, model, await rollout(model, "x"))
        await backend.close()
    finally:
        server.stop()


async def test_concurrent_requests_are_sampled_in_few_batched_calls(
    tiny_model_dir: Path, tmp_path: Path
):
    """64 requests at once cost a few sampler calls, not 64 (see server/sample_batching)."""
    from posttrain.server import sample_batching as openai_batching

    backend = art.LocalBackend(tmp_path)
    model = art.TrainableModel(
        name="agent", project="p", base_model=str(tiny_model_dir), lora_rank=4
    )
    await model.register(backend)
    calls: list[int] = []
    original = openai_batching.ModelSampler.sample_many

    async def counted(self, prompts, num_samples, params):
        calls.append(len(prompts))
        return await original(self, prompts, num_samples, params)

    openai_batching.ModelSampler.sample_many = counted
    try:
        trajectories = await asyncio.gather(*(rollout(model, w) for w in WORDS for _ in range(16)))
    finally:
        openai_batching.ModelSampler.sample_many = original
    assert sum(calls) == 64 and len(calls) <= 8, calls
    for trajectory in trajectories[:4]:
        await assert_exact(backend, model, trajectory)
    await backend.close()
