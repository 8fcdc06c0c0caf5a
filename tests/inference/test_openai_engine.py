"""`OpenAIEngine` against a real `posttrain serve` (samples, logprobs, seeds, EOS, errors) and,
for what posttrain serve cannot show, a stub standing in for a third-party server: one without
logprobs or token ids, one refusing logprobs=0, vLLM's dev-mode weight reload."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import posttrain
from local_groups import synthetic_groups
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.data.seeds import prompt_seed
from posttrain.inference.config import InferenceConfig
from posttrain.inference.openai_engine import OpenAIEngine, OpenAIServerError
from posttrain.inference.protocol import SamplingEngine, WeightSnapshot
from posttrain.tokenizer import eos_token_id
from posttrain.types import ModelInput, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serve_helpers import KEY, ServerProcess  # pyright: ignore[reportMissingImports]

PROMPTS = [[104, 101, 108, 108, 111], [97, 98, 99]]
Json = dict[str, Any]
Answer = Callable[[str, Json], tuple[int, Json]]
PLAIN = "plain text"  # a stub's answer {PLAIN: "..."} goes as a plain-text body, as vLLM's may


def config(url: str, **fields: Any) -> InferenceConfig:
    return InferenceConfig(engine="openai", url=url, **fields)


# -- a real `posttrain serve` ----------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tiny_model_dir: Path) -> Iterator[LocalTrainingClient]:
    """The served base model in this process: full weights, untouched."""
    client = create_training_client(tiny_model_dir, lora_rank=None, seed=0)
    assert isinstance(client, LocalTrainingClient)
    yield client
    client.close()


@pytest.fixture
async def engine(server: ServerProcess) -> AsyncIterator[OpenAIEngine]:
    # sync = 'none': the server's own weights (posttrain serve cannot take new ones).
    engine = OpenAIEngine(config(f"{server.url}/v1", api_key=KEY, sync="none"), version=7)
    await engine.start()
    yield engine
    await engine.close()


@pytest.mark.slow  # a server subprocess
async def test_samples_the_served_models_tokens_and_logprobs(
    engine: OpenAIEngine, local: LocalTrainingClient, tiny_model_dir: Path
) -> None:
    assert isinstance(engine, SamplingEngine) and engine.model == str(tiny_model_dir)
    caps = engine.capabilities
    assert caps.returns_token_ids and caps.returns_logprobs and caps.weight_sync == "none"
    params = SamplingParams(max_tokens=40, seed=5)
    responses = await engine.sample_many(PROMPTS, 6, params)
    eos = eos_token_id(local.get_tokenizer())
    reasons = set()
    for i, (prompt, response) in enumerate(zip(PROMPTS, responses, strict=True)):
        assert response.policy_version == 7 and len(response.sequences) == 6
        # posttrain's sampler in this process, seeded as the engine seeds prompt i: the same
        # tokens, stop reasons and logprobs (fp32, one thread each side), to float32 rounding.
        alone = SamplingParams(max_tokens=40, seed=prompt_seed(5, i))
        same = local.sample(ModelInput.from_ints(prompt), 6, alone).result()
        for ours, theirs in zip(response.sequences, same.sequences, strict=True):
            assert ours.tokens == theirs.tokens and ours.stop_reason == theirs.stop_reason
            assert ours.logprobs == pytest.approx(theirs.logprobs, rel=0, abs=1e-6)
            # Teacher-forced logprobs of the base model (fp32; another kernel than the
            # sampler's cached decode, ~1e-6 apart), at temperature 1.
            forced = local.compute_logprobs(ModelInput.from_ints(prompt + ours.tokens)).result()
            assert ours.logprobs == pytest.approx(forced[len(prompt) :], rel=0, abs=1e-5)
            # stop=None: ends at EOS ("stop", EOS last) or at max_tokens ("length").
            reasons.add(ours.stop_reason)
            if ours.stop_reason == "stop":
                assert ours.tokens[-1] == eos and eos not in ours.tokens[:-1]
            else:
                assert len(ours.tokens) == 40 and eos not in ours.tokens
    assert reasons == {"stop", "length"}  # seed 5 gives both


@pytest.mark.slow  # a server subprocess
async def test_seeded_samples_reproduce_whatever_else_is_in_the_batch(
    engine: OpenAIEngine,
) -> None:
    params = SamplingParams(max_tokens=12, seed=5)
    first = await engine.sample_many(PROMPTS, 3, params)
    again = await engine.sample_many(PROMPTS, 3, params)
    alone = await engine.sample_many(PROMPTS[:1], 3, params)
    assert first == again
    assert first[0] == alone[0]  # batch-independent: prompt 0 is seeded by (5, 0) either way
    swapped = await engine.sample_many(PROMPTS[::-1], 3, params)
    assert swapped[1].sequences != first[0].sequences  # ... and the index seeds it
    unseeded = await engine.sample_many(PROMPTS, 2, SamplingParams(max_tokens=4))
    assert [len(r.sequences) for r in unseeded] == [2, 2]


@pytest.mark.slow  # a server subprocess
async def test_posttrain_serve_cannot_replace_eos_and_is_refused_for_it(
    engine: OpenAIEngine,
) -> None:
    # stop=[] asks never to stop early (vLLM's ignore_eos); posttrain serve stops at EOS
    # anyway, which the engine catches rather than train on the wrong stop.
    with pytest.raises(OpenAIServerError, match="ignores vLLM's ignore_eos"):
        await engine.sample_many(PROMPTS, 6, SamplingParams(max_tokens=40, seed=5, stop=[]))


@pytest.mark.slow  # a server subprocess
async def test_http_errors_name_the_url_status_and_message(server: ServerProcess) -> None:
    url = f"{server.url}/v1"
    unknown = OpenAIEngine(config(url, api_key=KEY, model="no-such-model"))
    with pytest.raises(OpenAIServerError) as err:
        await unknown.start()
    assert err.value.status == 404
    assert f"{url}/completions answered 404: model 'no-such-model' does not exist" in str(err.value)
    keyless = OpenAIEngine(config(url))
    with pytest.raises(
        OpenAIServerError, match=re.escape(f"GET {url}/models answered 401: missing API key")
    ):
        await keyless.start()


# -- no server needed -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(max_tokens=4, top_k=5), "top_k = -1 and top_p = 1 only"),
        (SamplingParams(max_tokens=4, top_p=0.9), "top_k = -1 and top_p = 1 only"),
        (SamplingParams(max_tokens=4, entropies=True), "does not return token entropies"),
        (SamplingParams(max_tokens=4, min_p=0.1), r"asked: min_p = 0\.1\)"),
        (SamplingParams(max_tokens=4, repetition_penalty=1.2), "asked: repetition_penalty = 1.2"),
        (SamplingParams(max_tokens=4, presence_penalty=0.5), "asked: presence_penalty = 0.5"),
        (SamplingParams(max_tokens=4, frequency_penalty=-1), "asked: frequency_penalty = -1"),
        (SamplingParams(), "needs SamplingParams.max_tokens"),
    ],
)
async def test_what_the_engine_cannot_match_is_refused(params: SamplingParams, match: str):
    engine = OpenAIEngine(config("http://127.0.0.1:9/v1"))  # never contacted
    with pytest.raises(ValueError, match=match):
        await engine.sample_many(PROMPTS, 1, params)


async def test_without_weight_sync_new_weights_are_refused(tmp_path: Path) -> None:
    engine = OpenAIEngine(config("http://127.0.0.1:9/v1", sync="none"), version=2)
    assert engine.capabilities.weight_sync == "none"
    with pytest.raises(RuntimeError, match="samples a fixed policy"):
        await engine.update_weights(WeightSnapshot(tmp_path, 3), 3)
    assert engine.version == 2
    # 'auto' follows training as 'reload' does (the session refuses a server that cannot).
    assert OpenAIEngine(config("http://127.0.0.1:9/v1")).capabilities.weight_sync == "full"
    # 'lora' follows training too, through adapters (test_openai_lora.py).
    assert OpenAIEngine(config("http://127.0.0.1:9/v1", sync="lora")).capabilities.weight_sync == (
        "full"
    )
    with pytest.raises(ValueError, match="keep must be >= 2 adapter versions, got 1"):
        OpenAIEngine(config("http://127.0.0.1:9/v1", sync="lora"), keep=1)


@pytest.mark.slow  # a server subprocess
async def test_posttrain_serve_as_the_engine(
    server: ServerProcess,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """posttrain serve has no dev-mode endpoints. sync = 'auto' is refused at register, the
    model left unregistered; sync = 'none' trains, off-policy, and says so."""
    url = f"{server.url}/v1"
    refused = posttrain.LocalBackend(
        tmp_path / "auto", inference={"engine": "openai", "url": url, "api_key": KEY}
    )
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4
    )
    with pytest.raises(OpenAIServerError, match="VLLM_SERVER_DEV_MODE=1"):
        await model.register(refused)
    with pytest.raises(RuntimeError, match="not registered"):
        refused.client(model)
    await refused.close()

    fixed = posttrain.LocalBackend(
        tmp_path / "none",
        inference={"engine": "openai", "url": url, "api_key": KEY, "sync": "none"},
    )
    with caplog.at_level(logging.WARNING):
        await model.register(fixed)
    assert "samples its own fixed weights" in caplog.text
    for step in (1, 2):
        result = await fixed.train(
            model, synthetic_groups(step), learning_rate=1e-2, save_checkpoint=False
        )
        assert result.step == step and result.metrics["sampler_steps_behind"] == step
    sampled = await fixed.sampling_client(model).sample([104, 105], 1, SamplingParams(max_tokens=2))
    assert sampled.policy_version == 0  # the server's weights, whatever the model's step
    await fixed.close()


# -- a stub third-party server ----------------------------------------------------------------


class StubServer:
    """An HTTP server on loopback answering each request with `answer(path, body)`; records
    (method, path, body) of each."""

    def __init__(self, answer: Answer) -> None:
        self.requests: list[tuple[str, str, Json]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._reply("GET", {})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                self._reply("POST", json.loads(raw) if raw else {})

            def _reply(self, method: str, body: Json) -> None:
                stub.requests.append((method, self.path, body))
                status, payload = answer(self.path, body)
                text = PLAIN in payload
                data = str(payload[PLAIN]).encode() if text else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "text/plain" if text else "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=10)

    def completions(self) -> list[Json]:
        return [body for _, path, body in self.requests if path == "/v1/completions"]


@pytest.fixture
def stub() -> Iterator[Callable[[Answer], StubServer]]:
    started: list[StubServer] = []

    def start(answer: Answer) -> StubServer:
        started.append(StubServer(answer))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def vllm_like(*, ids: bool = True, logprobs: bool = True, finish: str = "length") -> Answer:
    """Completions of three tokens, 5 6 7, with or without vLLM's token ids and logprobs."""

    def answer(path: str, body: Json) -> tuple[int, Json]:
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "served", "object": "model"}]}
        if path != "/v1/completions":
            return 404, {"detail": "Not Found"}
        choices = []
        for index in range(body["n"]):
            choice: Json = {"index": index, "text": "abc", "finish_reason": finish}
            if ids:
                choice["token_ids"] = [5, 6, 7]
            tokens = ["a", "b", "c"]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": [-1.0, -2.0, -0.5]}
            if not logprobs:
                choice["logprobs"] = None
            choices.append(choice)
        return 200, {"object": "text_completion", "choices": choices[::-1]}  # any order

    return answer


async def test_a_server_without_logprobs_is_refused_unless_allowed(stub) -> None:
    server = stub(vllm_like(logprobs=False))
    engine = OpenAIEngine(config(server.url))
    with pytest.raises(OpenAIServerError, match="allow_training_without_logprobs = true"):
        await engine.start()
    allowed = OpenAIEngine(config(server.url, allow_training_without_logprobs=True))
    await allowed.start()
    assert allowed.model == "served" and not allowed.capabilities.returns_logprobs
    [response] = await allowed.sample_many([[1, 2]], 2, SamplingParams(max_tokens=3))
    assert [s.logprobs for s in response.sequences] == [None, None]
    assert [s.tokens for s in response.sequences] == [[5, 6, 7]] * 2
    await allowed.close()


async def test_a_server_without_token_ids_is_refused(stub) -> None:
    server = stub(vllm_like(ids=False))  # OpenAI's own shape: text and text tokens only
    engine = OpenAIEngine(config(server.url))
    with pytest.raises(OpenAIServerError, match="returns no token ids"):
        await engine.start()


async def test_requests_carry_per_prompt_seeds_neutral_settings_and_stops(stub) -> None:
    server = stub(vllm_like(finish="stop"))
    engine = OpenAIEngine(config(server.url, model="m", api_key="k"))
    await engine.start()
    probe = server.completions()[0]
    assert probe["prompt"] == [1, 2, 3] and probe["max_tokens"] == 1 and probe["logprobs"] == 0
    await engine.sample_many([[1], [2]], 2, SamplingParams(max_tokens=3, seed=9))
    # The two requests are concurrent, so they may reach the server in either order.
    bodies = sorted(server.completions()[1:], key=lambda b: b["prompt"])
    assert [b["prompt"] for b in bodies] == [[1], [2]]
    assert [b["seed"] for b in bodies] == [prompt_seed(9, 0), prompt_seed(9, 1)]
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert all(
        b.items() >= {**neutral, "model": "m", "n": 2, "ignore_eos": False}.items() for b in bodies
    )
    assert "stop" not in bodies[0] and "stop_token_ids" not in bodies[0]
    # An explicit stop replaces EOS: vLLM's ignore_eos with the stop tokens or strings.
    await engine.sample_many([[1]], 1, SamplingParams(max_tokens=3, stop=[7]))
    assert server.completions()[-1].items() >= {"ignore_eos": True, "stop_token_ids": [7]}.items()
    await engine.sample_many([[1]], 1, SamplingParams(max_tokens=3, stop="x"))
    assert server.completions()[-1].items() >= {"ignore_eos": True, "stop": ["x"]}.items()
    with pytest.raises(OpenAIServerError, match=r"stopped at a token not in SamplingParams\.stop"):
        await engine.sample_many([[1]], 1, SamplingParams(max_tokens=3, stop=[9]))
    await engine.close()


async def test_logprobs_1_where_a_server_refuses_0(stub) -> None:
    def answer(path: str, body: Json) -> tuple[int, Json]:
        if body.get("logprobs") == 0:
            return 400, {"error": {"message": "logprobs must be >= 1"}}
        return vllm_like()(path, body)

    server = stub(answer)
    engine = OpenAIEngine(config(server.url, model="m"))
    await engine.start()
    [response] = await engine.sample_many([[1]], 1, SamplingParams(max_tokens=3))
    assert response.sequences[0].logprobs == [-1.0, -2.0, -0.5]
    assert server.completions()[-1]["logprobs"] == 1
    await engine.close()


async def test_reload_sends_the_snapshot_to_vllms_dev_endpoints(stub, tmp_path: Path) -> None:
    def answer(path: str, body: Json) -> tuple[int, Json]:
        if path == "/collective_rpc":
            return 200, {"results": [None]}
        return vllm_like()(path, body)  # /reset_prefix_cache: 404, which is ignored

    server = stub(answer)
    engine = OpenAIEngine(config(server.url, model="m", sync="reload"), version=1)
    assert engine.capabilities.weight_sync == "full"
    await engine.start()
    await engine.update_weights(WeightSnapshot(tmp_path, 2), 2)
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    assert ("POST", "/collective_rpc", rpc) in server.requests
    assert server.requests[-1][:2] == ("POST", "/reset_prefix_cache")
    [response] = await engine.sample_many([[1]], 1, SamplingParams(max_tokens=3))
    assert engine.version == 2 == response.policy_version
    await engine.close()

    plain = stub(vllm_like())  # no dev mode: /collective_rpc is 404
    engine = OpenAIEngine(config(plain.url, model="m", sync="reload"), version=1)
    await engine.start()
    with pytest.raises(OpenAIServerError, match="VLLM_SERVER_DEV_MODE=1"):
        await engine.update_weights(WeightSnapshot(tmp_path, 2), 2)
    assert engine.version == 1
    await engine.close()
