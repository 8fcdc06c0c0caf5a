"""`[inference] sync = "lora"` on the openai engine, against a stub of vLLM's runtime LoRA
endpoints: each step's adapter loads under a new versioned name which requests then use, old
names are unloaded once no request in flight uses them (at most `keep` loaded), and what the
server or vLLM's LoRA cannot take is refused at registration, never after a step."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.inference.test_openai_engine import PLAIN, Json, StubServer, vllm_like
from tests.inference.test_openai_sync import open_session as sync_session

from posttrain.inference.config import InferenceConfig
from posttrain.inference.openai_engine import OpenAIEngine, OpenAIServerError
from posttrain.inference.protocol import WeightSnapshot
from posttrain.inference.session import EngineSession
from posttrain.types import SamplingParams

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
FLAGS = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank 8 --max-loras 3"


class LoraStub:
    """vLLM's runtime LoRA as its server answers: load refuses a taken name (400), unload an
    unknown one (404), completions an unknown model (404). A completion for a name in `hold`
    waits until its event is set. Records the names loaded at once, at most."""

    def __init__(self, *, dev_mode: bool = False) -> None:
        self.loaded: dict[str, Path] = {}
        self.configs: dict[str, Json] = {}  # each adapter's config, read when it loaded
        self.most_loaded = 0
        self.hold: dict[str, threading.Event] = {}
        self.dev_mode = dev_mode
        self.server = StubServer(self.answer)

    def answer(self, path: str, body: Json) -> tuple[int, Json]:
        if path == LOAD:
            name = body["lora_name"]
            if name in self.loaded:
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been"}}
            directory = Path(body["lora_path"])
            self.configs[name] = json.loads((directory / "adapter_config.json").read_text())
            assert (directory / "adapter_model.safetensors").is_file()
            self.loaded[name] = directory
            self.most_loaded = max(self.most_loaded, len(self.loaded))
            return 200, {PLAIN: f"Success: LoRA adapter '{name}' added successfully."}
        if path == UNLOAD:
            if self.loaded.pop(body["lora_name"], None) is None:
                return 404, {"error": {"message": "cannot be found"}}
            return 200, {PLAIN: f"Success: LoRA adapter '{body['lora_name']}' removed."}
        if path == "/v1/completions":
            model = body["model"]
            if model not in ("m", "served", *self.loaded):
                return 404, {"error": {"message": f"model {model!r} does not exist"}}
            if model in self.hold:
                self.hold[model].wait(timeout=30)
        if self.dev_mode and path in ("/collective_rpc", "/reset_prefix_cache"):
            return 200, {"results": [None]}
        return vllm_like()(path, body)

    def calls(self) -> list[tuple[str, str]]:
        """(path, name) of each load, unload and completion, in order."""
        return [
            (path, body.get("lora_name") or body.get("model", ""))
            for _, path, body in self.server.requests
            if path in (LOAD, UNLOAD, "/v1/completions")
        ]


@pytest.fixture
def lora_stub() -> Iterator[LoraStub]:
    stub = LoraStub()
    yield stub
    stub.server.stop()


def adapter_dir(root: Path, version: int) -> Path:
    directory = root / f"v{version}"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (directory / "adapter_model.safetensors").write_bytes(b"\0")
    return directory


def lora_snapshot(root: Path, version: int) -> WeightSnapshot:
    directory = adapter_dir(root, version)
    return WeightSnapshot(directory, version, kind="update", adapter=directory, bytes=1)


async def sample(engine: OpenAIEngine) -> int | None:
    [response] = await engine.sample_many([[1]], 1, SamplingParams(max_tokens=3))
    return response.policy_version


async def test_each_sync_serves_a_new_name_and_unloads_the_old_one(
    lora_stub: LoraStub, tmp_path: Path
) -> None:
    engine = OpenAIEngine(InferenceConfig(engine="openai", url=lora_stub.server.url, sync="lora"))
    await engine.start()  # the model's name, "served", from /v1/models
    for version in (1, 2, 3, 4):
        await engine.update_weights(lora_snapshot(tmp_path, version), version)
        assert await sample(engine) == version == engine.version
    loads = [(LOAD, f"served-posttrain-v{v}") for v in (1, 2, 3, 4)]
    unloads = [(UNLOAD, f"served-posttrain-v{v}") for v in (1, 2, 3)]
    samples = [("/v1/completions", f"served-posttrain-v{v}") for v in (1, 2, 3, 4)]
    # Load v(N+1), then unload vN (no request uses it), each sample on the newest name.
    expected = [("/v1/completions", "served"), loads[0], samples[0]]
    for i in range(3):
        expected += [loads[i + 1], unloads[i], samples[i + 1]]
    assert lora_stub.calls() == expected
    assert list(lora_stub.loaded) == ["served-posttrain-v4"] and lora_stub.most_loaded == 2
    # Unloaded adapters' directories are deleted; the served one's stays.
    assert [p.name for p in tmp_path.iterdir()] == ["v4"]
    await engine.close()  # a long-lived server keeps no stale name
    assert lora_stub.loaded == {} and not tmp_path.joinpath("v4").exists()


async def test_a_name_stays_loaded_while_a_request_uses_it_and_keep_bounds_them(
    lora_stub: LoraStub, tmp_path: Path
) -> None:
    """keep = 2: with v1's request still out and v2 served, v3 waits for v1's request."""
    config = InferenceConfig(engine="openai", url=lora_stub.server.url, model="m", sync="lora")
    engine = OpenAIEngine(config, keep=2)
    await engine.start()
    await engine.update_weights(lora_snapshot(tmp_path, 1), 1)
    release = lora_stub.hold["m-posttrain-v1"] = threading.Event()
    slow = asyncio.create_task(sample(engine))
    while ("/v1/completions", "m-posttrain-v1") not in lora_stub.calls():
        await asyncio.sleep(0.01)
    await engine.update_weights(lora_snapshot(tmp_path, 2), 2)
    assert list(lora_stub.loaded) == ["m-posttrain-v1", "m-posttrain-v2"]  # v1 in flight
    assert await sample(engine) == 2  # new requests take v2 at once
    third = asyncio.create_task(engine.update_weights(lora_snapshot(tmp_path, 3), 3))
    await asyncio.sleep(0.3)
    assert not third.done() and len(lora_stub.loaded) == 2  # 2 loaded: v3 waits
    release.set()
    assert await slow == 1  # the request made with v1 reports v1
    await third
    # (Requests are recorded as they arrive: v1's long before it returned.)
    assert lora_stub.calls()[-4:] == [
        ("/v1/completions", "m-posttrain-v2"),
        (UNLOAD, "m-posttrain-v1"),  # its request returned: unloaded, then v3 loads
        (LOAD, "m-posttrain-v3"),
        (UNLOAD, "m-posttrain-v2"),
    ]
    assert lora_stub.most_loaded == 2 and engine.version == 3
    await engine.close()


async def test_a_resync_of_the_same_step_gets_a_name_of_its_own(
    lora_stub: LoraStub, tmp_path: Path
) -> None:
    """After a failed step the session syncs the current step again: a fresh name, never a
    name whose prefix cache holds other weights."""
    config = InferenceConfig(engine="openai", url=lora_stub.server.url, model="m", sync="lora")
    engine = OpenAIEngine(config)
    await engine.start()
    await engine.update_weights(lora_snapshot(tmp_path, 3), 3)
    (tmp_path / "again").mkdir()
    await engine.update_weights(lora_snapshot(tmp_path / "again", 3), 3)
    assert list(lora_stub.loaded) == ["m-posttrain-v3-2"]
    assert await sample(engine) == 3 and lora_stub.calls()[-1][1] == "m-posttrain-v3-2"
    await engine.close()


# -- through the engine session, as registration and each step use it -------------------------


async def open_session(
    url: str, model_dir: Path, tmp_path: Path, sync: str, **lora: Any
) -> tuple[Any, EngineSession]:
    """A LoRA-4 model's session at step 3, its adapter on attention and MLP by default."""
    options = {"train_unembed": False, **lora}
    return await sync_session(url, model_dir, tmp_path, options, sync=sync)


@pytest.mark.parametrize("sync", ["lora", "auto"])
async def test_registration_loads_the_adapter_and_each_sync_a_new_one(
    lora_stub: LoraStub, tiny_model_dir: Path, tmp_path: Path, sync: str
) -> None:
    client, session = await open_session(lora_stub.server.url, tiny_model_dir, tmp_path, sync)
    assert list(lora_stub.loaded) == ["m-posttrain-v3"]  # the model's step, at registration
    config = lora_stub.configs["m-posttrain-v3"]
    assert config["r"] == 4 and config["lora_alpha"] == 32.0  # the default alpha at rank 4
    assert "lm_head" not in config["target_modules"]
    first = lora_stub.loaded["m-posttrain-v3"]
    files = sum(f.stat().st_size for f in first.iterdir())
    assert session.last_sync["sync_bytes"] == files and session.last_sync["sync_version"] == 3
    await session.sync(4)
    assert list(lora_stub.loaded) == ["m-posttrain-v4"] and not first.exists()
    assert session.last_sync["sync_version"] == 4 and session.last_sync["sync_s"] > 0
    assert not [r for r in lora_stub.server.requests if r[1] == "/collective_rpc"]
    await session.close()
    client.close()


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (404, "Not Found"),  # no VLLM_ALLOW_RUNTIME_LORA_UPDATING: no such route
        (500, "LoRA is not enabled. Use --enable-lora to enable LoRA."),  # vLLM 0.32's answer
        (400, "LoRA is not enabled"),
    ],
)
async def test_a_server_without_runtime_lora_is_refused_at_registration(
    tiny_model_dir: Path, tmp_path: Path, status: int, message: str
) -> None:
    def answer(path: str, body: Json) -> tuple[int, Json]:
        if path == LOAD:
            return status, {"error": {"message": message}}
        return vllm_like()(path, body)

    server = StubServer(answer)
    try:
        with pytest.raises(OpenAIServerError) as refused:
            await open_session(server.url, tiny_model_dir, tmp_path, "lora")
    finally:
        server.stop()
    text = str(refused.value)
    assert f"answered {status}: {message}" in text and FLAGS in text
    assert "or set [inference] sync = 'reload'" in text
    assert refused.value.status == status


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"train_unembed": True}, r"cannot carry what this model trains: an adapter on lm_head"),
        ({"lora_rank": None}, "trains no LoRA of a linear layer"),
    ],
)
async def test_what_vllms_lora_cannot_carry_is_refused_before_the_server_is_asked(
    lora_stub: LoraStub, tiny_model_dir: Path, tmp_path: Path, lora: Json, match: str
) -> None:
    with pytest.raises(ValueError, match=match) as refused:
        await open_session(lora_stub.server.url, tiny_model_dir, tmp_path, "lora", **lora)
    fix = "train_unembed = false" if lora.get("train_unembed") else "full fine-tuning"
    assert fix in str(refused.value) and "set sync = 'reload'" in str(refused.value)
    assert lora_stub.server.requests == []


async def test_auto_sends_whole_weights_where_the_adapter_or_the_server_cannot(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dev_only = LoraStub(dev_mode=True)  # dev-mode endpoints, no runtime LoRA

    def no_lora(path: str, body: Json) -> tuple[int, Json]:
        return (404, {"detail": "Not Found"}) if path == LOAD else dev_only.answer(path, body)

    dev_only.server.stop()
    dev_only.server = StubServer(no_lora)
    full = LoraStub(dev_mode=True)  # both
    try:
        with caplog.at_level(logging.WARNING):
            client, session = await open_session(
                dev_only.server.url, tiny_model_dir, tmp_path / "a", "auto"
            )
        assert "sync = 'auto' sends whole weights instead" in caplog.text
        paths = [path for _, path, _ in dev_only.server.requests]
        assert paths.count(LOAD) == 1 and paths.count("/collective_rpc") == 1
        await session.close()
        client.close()
        # An adapter on lm_head: whole weights, the adapter never offered.
        client, session = await open_session(
            full.server.url, tiny_model_dir, tmp_path / "b", "auto", train_unembed=None
        )
        paths = [path for _, path, _ in full.server.requests]
        assert LOAD not in paths and paths.count("/collective_rpc") == 1
        await session.close()
        client.close()
    finally:
        dev_only.server.stop()
        full.server.stop()


async def test_an_update_the_server_cannot_load_is_refused(
    lora_stub: LoraStub, tmp_path: Path
) -> None:
    """Tensors to write in place (an lm_head adapter, full fine-tuning) have no endpoint."""
    engine = OpenAIEngine(InferenceConfig(engine="openai", url=lora_stub.server.url, model="m"))
    await engine.start()
    tensors = WeightSnapshot(tmp_path, 1, kind="update", tensors=tmp_path / "tensors.safetensors")
    with pytest.raises(ValueError, match=r"a LoRA adapter alone.*use sync = 'reload'"):
        await engine.update_weights(tensors, 1)
    assert engine.version == 0 and lora_stub.calls() == [("/v1/completions", "m")]
    await engine.close()
