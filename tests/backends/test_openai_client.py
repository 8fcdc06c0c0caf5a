"""`model.openai_client()` on LocalBackend: the loopback server, fresh weights, threads, close."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import openai
import pytest
import torch

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.types import SamplingParams

PROMPT = [104, 101, 108, 108, 111, 32]  # "hello " in the tiny byte-level vocabulary


def groups(seed: int, size: int = 4, length: int = 6) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        prompt = TokenSegment(tuple(rng.randrange(3, 250) for _ in range(5)))
        trajectories = []
        for _ in range(size):
            n = rng.randrange(2, length + 1)
            sampled = TokenSegment(
                tuple(rng.randrange(3, 250) for _ in range(n)),
                trainable=True,
                logprobs=tuple(-5.5 + rng.random() for _ in range(n)),
            )
            trajectories.append(Trajectory((prompt, sampled), reward=float(rng.random() > 0.5)))
        out.append(TrajectoryGroup(tuple(trajectories)))
    return out


def weights_of(backend: LocalBackend, model: TrainableModel) -> dict[str, torch.Tensor]:
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    return {n: p.detach().clone() for n, p in worker.trainable_parameters().items()}


def tiny(name: str, tiny_model_dir: Path) -> TrainableModel:
    return TrainableModel(name=name, project="p", base_model=str(tiny_model_dir), lora_rank=4)


async def test_chat_through_openai_client_serves_the_latest_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    backend = LocalBackend(tmp_path)
    model = tiny("agent", tiny_model_dir)
    await model.register(backend)
    client = model.openai_client()
    assert model.inference_model_name == "agent"
    assert str(client.base_url).startswith("http://127.0.0.1:")
    chat = await client.chat.completions.create(
        model=model.inference_model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        seed=2,
        logprobs=True,
    )
    assert chat.choices[0].model_extra is not None
    assert len(chat.choices[0].model_extra["token_ids"]) == len(chat.choices[0].logprobs.content)  # pyright: ignore[reportArgumentType, reportOptionalMemberAccess]

    async def served(seed: int) -> tuple[list[int], list[float]]:
        out = await client.completions.create(
            model="agent", prompt=PROMPT, seed=seed, max_tokens=10, logprobs=0
        )
        return out.choices[0].model_extra["token_ids"], out.choices[0].logprobs.token_logprobs  # pyright: ignore[reportOptionalSubscript, reportReturnType, reportOptionalMemberAccess]

    before_tokens, before_logprobs = await served(3)
    await backend.train(model, groups(0), learning_rate=5e-2)
    after_tokens, after_logprobs = await served(3)
    # The server samples the trained weights: exactly what in-process sampling gives now ...
    now = await backend.sampling_client(model).sample(
        PROMPT, 1, SamplingParams(max_tokens=10, seed=3)
    )
    assert (after_tokens, after_logprobs) == (now.sequences[0].tokens, now.sequences[0].logprobs)
    # ... and the tokens served before training have other logprobs under the new weights
    # (a 5e-2 LoRA step moves them by >1e-3; float32 noise is ~1e-6).
    forced = await backend.sampling_client(model).compute_logprobs(PROMPT + before_tokens)
    moved = [
        abs(a - b)
        for a, b in zip(forced[len(PROMPT) :], before_logprobs, strict=True)
        if a is not None
    ]
    assert len(moved) == len(before_tokens) and max(moved) > 1e-3

    base_url = str(client.base_url)
    await backend.close()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as http:
            await http.get(base_url + "models")


async def test_a_closed_client_is_never_handed_out_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """User code that closes its client (`async with`, a cleanup) leaves the next rollout's
    openai_client() a working one, not "the client has been closed"."""
    backend = LocalBackend(tmp_path)
    model = tiny("closer", tiny_model_dir)
    await model.register(backend)
    try:
        async with model.openai_client() as client:
            assert model.openai_client() is client  # shared within the loop while open
        assert client.is_closed()
        again = model.openai_client()
        assert again is not client and not again.is_closed()
        out = await again.completions.create(
            model=model.inference_model_name, prompt=PROMPT, max_tokens=2, seed=0
        )
        assert out.choices[0].text is not None
        assert model.openai_client() is again
    finally:
        await backend.close()


async def test_sampling_while_training_is_serialized_and_changes_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Requests during train() see the old or the new weights, and training is unaffected.

    Two models with the same seed start identical; one trains while the server samples it
    nonstop, the other trains alone. Their weights must stay bit-identical.
    """
    backend = LocalBackend(tmp_path)
    busy, quiet = tiny("busy", tiny_model_dir), tiny("quiet", tiny_model_dir)
    await busy.register(backend)
    await quiet.register(backend)
    client = busy.openai_client()
    params = SamplingParams(max_tokens=8, seed=9)
    # Enough tokens that forward_backward takes far longer than one request's round trip.
    many = groups(1, size=32, length=200)

    async def served() -> tuple[list[int], list[float]]:
        out = await client.completions.create(
            model="busy", prompt=PROMPT, seed=9, max_tokens=8, logprobs=0
        )
        return out.choices[0].model_extra["token_ids"], out.choices[0].logprobs.token_logprobs  # pyright: ignore[reportOptionalSubscript, reportReturnType, reportOptionalMemberAccess]

    def as_pair(sequence) -> tuple[list[int], list[float]]:
        return sequence.tokens, sequence.logprobs

    old = as_pair((await backend.sampling_client(busy).sample(PROMPT, 1, params)).sequences[0])
    assert await served() == old  # also opens the connection before the race below
    transitions = backend.client(busy).dispatch.transitions
    first = len(transitions)
    training = asyncio.create_task(backend.train(busy, many, learning_rate=5e-2))
    answers = []
    while not training.done():
        answers.extend(await asyncio.gather(*(served() for _ in range(3))))
    await training
    # Placements went train (forward_backward) -> sample (requests) -> train (optim_step):
    # requests really ran between the step's training calls.
    assert transitions[first : first + 3] == [
        ("sample", "train"),
        ("train", "sample"),
        ("sample", "train"),
    ]
    await backend.train(quiet, many, learning_rate=5e-2)
    new = as_pair((await backend.sampling_client(busy).sample(PROMPT, 1, params)).sequences[0])
    assert new != old
    assert answers and all(a in (old, new) for a in answers)
    busy_weights, quiet_weights = weights_of(backend, busy), weights_of(backend, quiet)
    assert busy_weights.keys() == quiet_weights.keys()
    assert all(torch.equal(busy_weights[k], quiet_weights[k]) for k in busy_weights)
    await backend.close()


async def test_clear_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    model = tiny("m", tiny_model_dir)
    with pytest.raises(RuntimeError, match="not registered"):
        model.openai_client()
    await model.register(backend)
    twin = TrainableModel(name="m", project="other", base_model=str(tiny_model_dir), lora_rank=4)
    await twin.register(backend)
    with pytest.raises(ValueError, match="several projects"):
        model.openai_client()
    await backend.close()

    class NoServing:  # a backend without `openai_endpoint`
        pass

    stranded = tiny("s", tiny_model_dir)
    stranded.attach(NoServing(), tmp_path / "s", 0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(NotImplementedError, match="NoServing cannot serve"):
        stranded.openai_client()


async def test_wrong_api_key_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    model = tiny("m", tiny_model_dir)
    await model.register(backend)
    endpoint = model.openai_endpoint()
    assert endpoint.base_url.startswith("http://127.0.0.1:")
    intruder = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await intruder.models.list()
    await backend.close()


def test_backends_never_import_the_server_layer() -> None:
    """LocalBackend finds its OpenAI server through the `posttrain.openai_servers` entry point
    (declared in pyproject.toml), so no module under backends/ imports posttrain.server."""
    import ast
    import importlib.metadata

    import posttrain.backends

    for path in Path(posttrain.backends.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("posttrain.server") for n in names), (path.name, names)
    (entry,) = importlib.metadata.entry_points(group="posttrain.openai_servers", name="local")
    assert entry.value == "posttrain.server.local_openai:LocalOpenAIServer"
