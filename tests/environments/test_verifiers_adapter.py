"""verifiers environments through the adapter, on LocalBackend's OpenAI endpoint: a
self-contained environment (tests/environments/verifiers_lowercase.py) trains and its reward
rises; its trajectories hold exactly the tokens and logprobs the endpoint sampled; a multi-turn
environment (verifiers_followup.py) trains exactly its assistant turns; failing rollouts are
counted and dropped within the bound; and a missing verifiers names its extra.

"Exactly" is checked as tests/backends/test_openai_rollouts_backends.py checks it: the trainer
scores each trajectory's tokens (`forward`), and every trainable token's logprob must equal the
endpoint's within 1e-5. Only float32 summation order differs (KV-cached decoding against one
full forward pass): measured up to 2e-6 here, while a token at the wrong position, another
temperature or other weights move a logprob by more than 1e-2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

import posttrain
from posttrain.environments import (
    EnvironmentSpecError,
    VerifiersEpisodeError,
    load_verifiers_env,
    resolve_environment,
    run_verifiers_episodes,
    verifiers_tasks,
)
from posttrain.environments.verifiers_adapter import import_verifiers
from posttrain.environments.verifiers_proxy import KEY_HEADER, RecordingProxy
from posttrain.types import Datum, ModelInput

TOL = 1e-5
LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}  # rollouts in this process, no sandbox


async def assert_exact(backend, model, trajectory: posttrain.Trajectory) -> None:
    """Every trainable token's logprob equals the trainer's (a forward pass, no update)."""
    tokens = trajectory.tokens
    datum = Datum(
        ModelInput.from_ints(tokens[:-1]),
        {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    out = await backend.client(model).forward([datum], "cross_entropy")
    forced = out.loss_fn_outputs[0]["logprobs"].tolist()  # forced[i] scores tokens[i + 1]
    position = 0
    for segment in trajectory.segments:
        if segment.trainable:
            expected = forced[position - 1 : position - 1 + len(segment.tokens)]
            assert list(segment.logprobs or ()) == pytest.approx(expected, abs=TOL)
        position += len(segment.tokens)


async def registered(directory: Path, base_model: Path, lora_rank: int | None):
    backend = posttrain.LocalBackend(directory)
    model = posttrain.TrainableModel(
        name="vf", project="p", base_model=str(base_model), lora_rank=lora_rank
    )
    await model.register(backend)
    return backend, model


@pytest.mark.slow  # eight RL steps of 16 episodes (about 10 s)
async def test_a_verifiers_env_trains_and_its_reward_rises(tiny_model_dir: Path, tmp_path: Path):
    backend, model = await registered(tmp_path, tiny_model_dir, lora_rank=None)
    env = load_verifiers_env("verifiers_lowercase", LOCAL)
    tasks = verifiers_tasks(env)
    assert [t.data.prompt for t in tasks] == ["say abc", "say hello", "say world", "say xyz"]
    means = []
    for step in range(8):
        played = await run_verifiers_episodes(
            model,
            env,
            tasks,
            group_size=4,
            sampling={"max_tokens": 8, "temperature": 1.0},
            seed=step,
        )
        assert (played.episodes, played.errors, [len(g) for g in played.groups]) == (
            16,
            [],
            [4, 4, 4, 4],
        )
        trajectories = [t for g in played.groups for t in g.trajectories]
        if step == 0:  # scored with the weights that sampled them
            assert trajectories[0].messages[0] == {"role": "user", "content": "say abc"}
            for trajectory in trajectories:
                assert [s.trainable for s in trajectory.segments] == [False, True]
                assert trajectory.metrics["reward_lowercase"] == trajectory.reward
                await assert_exact(backend, model, trajectory)
        means.append(sum(t.reward for t in trajectories) / len(trajectories))
        await backend.train(
            model, played.groups, learning_rate=5e-2, loss="ppo", save_checkpoint=False
        )
    # Seeded, so every run gives the same rewards (with one thread: 0.14 0.13 0.08 0.19 0.36
    # 0.58 0.84 0.96, twice); the margin is wide all the same.
    assert sum(means[-2:]) / 2 > sum(means[:2]) / 2 + 0.5, means
    await backend.close()


@pytest.mark.slow  # fine-tunes the chat model first (a few seconds)
async def test_a_multi_turn_verifiers_env_trains_exactly_its_assistant_turns(
    chat_model_dir: Path, tmp_path: Path
):
    backend, model = await registered(tmp_path, chat_model_dir, lora_rank=4)
    env = load_verifiers_env("verifiers_followup", LOCAL)
    sampling = {"max_tokens": 8, "temperature": 0.0}  # greedy: text that re-renders
    played = await run_verifiers_episodes(
        model, env, verifiers_tasks(env), group_size=2, sampling=sampling
    )
    assert [len(g) for g in played.groups] == [2, 2] and not played.errors
    tokenizer = backend.sampling_client(model).tokenizer
    for trajectory in (t for g in played.groups for t in g.trajectories):
        # The two replies are trainable; the prompt, the env's user turn and the template's
        # tokens between them are context.
        assert [s.trainable for s in trajectory.segments] == [False, True, False, True]
        between = tokenizer.decode(trajectory.segments[2].tokens)  # pyright: ignore[reportArgumentType]
        assert between == "<|im_start|>user\nagain<|eos|><|im_start|>assistant\n"
        roles = [m["role"] for m in trajectory.messages]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert trajectory.metrics["turns"] == 2.0
        await assert_exact(backend, model, trajectory)
    result = await backend.train(model, played.groups, learning_rate=1e-3, save_checkpoint=False)
    assert result.step == 1
    # A harness that sends the first reply back edited: the second turn's prompt does not
    # extend what was sampled, which the conversion refuses (nothing is re-rendered).
    harness = {"id": "verifiers_followup", "edit_history": True}
    env = load_verifiers_env(
        "verifiers_followup", {"agent": {**LOCAL["agent"], "harness": harness}}
    )
    with pytest.raises(VerifiersEpisodeError, match="turn 2: its prompt_token_ids do not start"):
        await run_verifiers_episodes(model, env, verifiers_tasks(env), sampling=sampling)
    await backend.close()


@pytest.mark.slow  # a model, an endpoint and 16 episodes (a few seconds)
async def test_failing_rollouts_are_counted_and_dropped_within_the_bound(
    tiny_model_dir: Path, tmp_path: Path
):
    backend, model = await registered(tmp_path, tiny_model_dir, lora_rank=4)
    # The reward is plugged in by verifiers' own config; its grader fails on the "xyz" task.
    flaky = {"fn": "verifiers_lowercase:reward_or_raise"}
    env = load_verifiers_env(
        "verifiers_lowercase", {**LOCAL, "taskset": {"task": {"rewards": {"lowercase": flaky}}}}
    )
    tasks = verifiers_tasks(env)
    sampling = {"max_tokens": 4}
    with pytest.raises(VerifiersEpisodeError, match=r"task 3: .*the grader is down"):
        await run_verifiers_episodes(model, env, tasks, group_size=2, sampling=sampling)
    played = await run_verifiers_episodes(
        model, env, tasks, group_size=2, sampling=sampling, max_exceptions=2
    )
    assert (played.episodes, len(played.errors), [len(g) for g in played.groups]) == (8, 2, [2] * 3)
    assert {t.metadata["task"] for g in played.groups for t in g.trajectories} == {0, 1, 2}
    # The proxy forwards only calls that carry its key, to the routes posttrain serves.
    async with RecordingProxy(model.openai_endpoint()) as proxy:
        http = httpx.AsyncClient(base_url=proxy.base_url)
        refused = await http.post("/responses", json={}, headers={KEY_HEADER: proxy.key})
        assert refused.status_code == 404
        assert "chat-completions dialect" in refused.json()["error"]["message"]
        assert (await http.post("/chat/completions", json={})).status_code == 401
        await http.aclose()
    await backend.train(model, played.groups, learning_rate=1e-3, save_checkpoint=False)
    await backend.close()


def test_a_missing_verifiers_names_its_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[verifiers\]'"):
        import_verifiers()
    with pytest.raises(EnvironmentSpecError, match=r"posttrain\[verifiers\]"):
        resolve_environment("verifiers:verifiers_lowercase")


def test_a_verifiers_spec_resolves_or_says_what_is_wrong():
    found = resolve_environment("verifiers:verifiers_lowercase", LOCAL)
    assert found.record() == {
        "spec": "verifiers:verifiers_lowercase",
        "kind": "verifiers",
        "target": "verifiers_lowercase:LowercaseTaskset",
    }
    with pytest.raises(TypeError, match="run_verifiers_episodes"):
        found.make()
    with pytest.raises(EnvironmentSpecError, match="name the verifiers taskset"):
        resolve_environment("verifiers:")
    with pytest.raises(EnvironmentSpecError, match=r"'no_such_taskset' does not load"):
        resolve_environment("verifiers:no_such_taskset")
    with pytest.raises(EnvironmentSpecError, match="agent"):
        resolve_environment("verifiers:verifiers_lowercase", {"agent": {"no_such_field": 1}})


ARENA = {"player": LOCAL["agent"], "select": {"limit": 3}}  # verifiers_arena's seat, bounded


def test_a_seat_of_another_name_and_an_endless_taskset():
    """verifiers' TextArena plays a seat named `player` and never ends (verifiers_arena.py does
    the same without its game): `agent` is refused naming the seat, an endless taskset says how
    to bound it, and `select = { limit = N }` bounds it."""
    with pytest.raises(EnvironmentSpecError, match=r"its seats are 'player'.*player = \{ runtime"):
        resolve_environment("verifiers:verifiers_arena", LOCAL)
    player = {"player": LOCAL["agent"]}
    with pytest.raises(EnvironmentSpecError, match=r"infinite.*select = \{ limit = N \}"):
        resolve_environment("verifiers:verifiers_arena", player)
    found = resolve_environment("verifiers:verifiers_arena", ARENA)
    assert found.record()["target"] == "verifiers_arena:ArenaTaskset"
    tasks = verifiers_tasks(load_verifiers_env("verifiers_arena", ARENA))
    assert [t.data.prompt for t in tasks] == ["move 0", "move 1", "move 2"]
    with pytest.raises(ValueError, match=r"select = \{'limit': 0\} is not a task selection"):
        load_verifiers_env("verifiers_arena", {**player, "select": {"limit": 0}})


@pytest.mark.slow  # a model's endpoint and two episodes (a few seconds)
async def test_a_bounded_endless_taskset_plays_on_its_own_seat(
    tiny_model_dir: Path, tmp_path: Path
):
    env = load_verifiers_env("verifiers_arena", ARENA)
    backend, model = await registered(tmp_path, tiny_model_dir, lora_rank=None)
    try:
        played = await run_verifiers_episodes(
            model, env, verifiers_tasks(env)[:1], group_size=2, sampling={"max_tokens": 4}, seed=0
        )
    finally:
        await backend.close()
    assert played.errors == [] and [len(g.trajectories) for g in played.groups] == [2]
    assert [t.metadata["task"] for t in played.groups[0].trajectories] == [0, 0]  # move 0
