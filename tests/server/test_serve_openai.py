"""The openai SDK against a real `posttrain serve`: /v1/completions and /v1/chat/completions for a
named sampler checkpoint (its tinker:// path is the model name), per API key; an overwritten
checkpoint is served with its new weights and a deleted one is refused (through /v1 and the
tinker SDK's sampling client, which sample from one cache of loaded samplers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serve_helpers import KEY, OTHER_KEY, ServerProcess

tinker = pytest.importorskip("tinker")
types = tinker.types

# Talks to the shared `posttrain serve` subprocess.
pytestmark = pytest.mark.slow

PROMPT = [104, 101, 108, 108, 111, 32]  # "hello " in the tiny byte-level vocabulary
TOKENS = [10, 72, 101, 108, 108, 111, 33]


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> Iterator[object]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


async def test_named_sampler_checkpoint_through_the_openai_sdk(
    server: ServerProcess, service, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=4)
    tc = tc.result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # away from the base model
    path = tc.save_weights_for_sampler("for-openai").result().path
    tinker_sampler = service.create_sampling_client(model_path=path)
    base_sampler = service.create_sampling_client(base_model=str(tiny_model_dir))

    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    names = [m.id for m in (await oai.models.list()).data]
    assert names[0] == str(tiny_model_dir) and path in names

    completion = await oai.completions.create(
        model=path, prompt=PROMPT, max_tokens=8, seed=5, logprobs=0
    )
    choice = completion.choices[0]
    extra = choice.model_extra or {}
    assert extra["prompt_token_ids"] == PROMPT
    tokens, logprobs = extra["token_ids"], choice.logprobs.token_logprobs  # pyright: ignore[reportOptionalMemberAccess]
    # The tinker SDK sampling the same checkpoint with the same seed: the same tokens and
    # logprobs (one loaded sampler serves both).
    params = types.SamplingParams(max_tokens=8, seed=5)
    same = tinker_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
    assert same.sequences[0].tokens == tokens
    assert same.sequences[0].logprobs == pytest.approx(logprobs, rel=1e-6, abs=1e-7)
    # They are the checkpoint's logprobs, not the base model's (teacher-forced on both).
    forced = types.ModelInput.from_ints(PROMPT + tokens)
    trained = tinker_sampler.compute_logprobs(forced).result()[len(PROMPT) :]
    base = base_sampler.compute_logprobs(forced).result()[len(PROMPT) :]
    assert trained == pytest.approx(logprobs, rel=1e-4, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(trained, base, strict=True)) > 1e-3

    chat = await oai.chat.completions.create(
        model=path,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        seed=2,
        logprobs=True,
    )
    message = chat.choices[0]
    chat_extra = message.model_extra or {}
    chat_prompt = (chat.model_extra or {})["prompt_token_ids"]
    content = message.logprobs.content or []  # pyright: ignore[reportOptionalMemberAccess]
    assert len(chat_extra["token_ids"]) == len(content) >= 1
    # The chat prompt is the model's chat template; sampling it through tinker gives the same.
    again = tinker_sampler.sample(
        types.ModelInput.from_ints(chat_prompt), 1, types.SamplingParams(max_tokens=6, seed=2)
    ).result()
    assert again.sequences[0].tokens == chat_extra["token_ids"]

    # Another key neither lists nor samples the checkpoint.
    intruder = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    assert path not in [m.id for m in (await intruder.models.list()).data]
    with pytest.raises(openai.NotFoundError):
        await intruder.completions.create(model=path, prompt=PROMPT, max_tokens=2)


def served(oai: openai.OpenAI, name: str) -> tuple[list[int], list[float]]:
    """Tokens and logprobs of a seeded /v1 completion."""
    out = oai.completions.create(model=name, prompt=PROMPT, max_tokens=6, seed=3, logprobs=0)
    choice = out.choices[0]
    return (choice.model_extra or {})["token_ids"], choice.logprobs.token_logprobs  # pyright: ignore[reportReturnType, reportOptionalMemberAccess]


def test_overwritten_sampler_weights_are_served_new_and_deleted_ones_refused(
    server: ServerProcess, service, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=6)
    tc = tc.result()
    path = tc.save_weights_for_sampler("published").result().path
    sampler = service.create_sampling_client(model_path=path)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    forced = types.ModelInput.from_ints(PROMPT + TOKENS)
    before = sampler.compute_logprobs(forced).result()[1:]  # the first token has none
    before_v1 = served(oai, path)  # both load (and cache) the sampler of `path`

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert tc.save_weights_for_sampler("published").result().path == path  # overwritten
    reference = tc.save_weights_for_sampler("reference").result().path  # the same new weights

    # The same weights through the same code on the server's one thread: equal, bit for bit.
    after = sampler.compute_logprobs(forced).result()[1:]
    reference_sampler = service.create_sampling_client(model_path=reference)
    assert after == reference_sampler.compute_logprobs(forced).result()[1:]
    after_v1 = served(oai, path)
    assert after_v1 == served(oai, reference)
    # And they are the new weights: a 5e-2 step moves the logprobs far beyond rounding.
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-2
    assert max(abs(a - b) for a, b in zip(after_v1[1], before_v1[1], strict=False)) > 1e-2

    run_id = path.removeprefix("tinker://").split("/")[0]
    directory = server.storage / "runs" / run_id.replace(":", "_") / "sampler_weights" / "published"
    assert directory.is_dir()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)  # create_rest_client is deprecated
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert not directory.exists()
    with pytest.raises(openai.NotFoundError):
        served(oai, path)
    with pytest.raises(tinker.NotFoundError, match="was deleted"):
        sampler.compute_logprobs(forced).result()
    assert served(oai, reference) == after_v1  # the other checkpoint is untouched
