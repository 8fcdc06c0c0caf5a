"""What a run with the openai engine means for each `[inference] sync`.

"auto" and "reload": the server takes the model's weights when the engine opens, at
registration, so a server that cannot (no vLLM dev-mode endpoints, as posttrain serve, SGLang
or a stock vLLM) is refused before any work, never after an optimizer step was applied.
"none": the server's own fixed weights, explicitly off-policy, each step reporting the gap.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.inference.test_openai_engine import Json, StubServer, vllm_like

from posttrain.clients.create import create_training_client
from posttrain.inference.config import InferenceConfig
from posttrain.inference.openai_engine import OpenAIServerError
from posttrain.inference.session import EngineSession
from posttrain.models.lora import LoraSettings


@pytest.fixture
def dev_mode() -> Iterator[StubServer]:
    """A vLLM-like server with the dev-mode endpoints: /collective_rpc answers."""

    def answer(path: str, body: Json) -> tuple[int, Json]:
        if path in ("/collective_rpc", "/reset_prefix_cache"):
            return 200, {"results": [None]}
        return vllm_like()(path, body)

    server = StubServer(answer)
    yield server
    server.stop()


@pytest.fixture
def plain() -> Iterator[StubServer]:
    """A server without them (/collective_rpc is 404), as SGLang or a stock vLLM."""
    server = StubServer(vllm_like())
    yield server
    server.stop()


async def open_session(
    url: str, tiny_model_dir: Path, tmp_path: Path, lora: Json | None = None, **fields: str
) -> tuple[Any, EngineSession]:
    """The engine session of a LoRA-4 model (`lora`: other client options), at step 3."""
    lora = {"lora_rank": 4, **(lora or {})}
    client = create_training_client(tiny_model_dir, storage_dir=tmp_path / "c", **lora)
    config = InferenceConfig(engine="openai", url=url, model="m", **fields)  # pyright: ignore[reportArgumentType]
    try:
        return client, await EngineSession.open(
            config,
            client,
            base_model=str(tiny_model_dir),
            lora=LoraSettings.of(lora["lora_rank"]),
            version=3,
            log_dir=tmp_path,
        )
    except BaseException:
        client.close()
        raise


@pytest.mark.parametrize("sync", ["auto", "reload"])
async def test_the_server_takes_the_models_weights_when_the_engine_opens(
    dev_mode: StubServer, tiny_model_dir: Path, tmp_path: Path, sync: str
) -> None:
    """Before any step: a resumed model's server samples its step's weights, not its own."""
    client, session = await open_session(dev_mode.url, tiny_model_dir, tmp_path, sync=sync)
    rpcs = [body for _, path, body in dev_mode.requests if path == "/collective_rpc"]
    assert [rpc["method"] for rpc in rpcs] == ["reload_weights"]
    assert (Path(rpcs[0]["kwargs"]["weights_path"]) / "model.safetensors").is_file()
    assert session.engine.version == 3
    assert session.policy_gap(4) == {}  # it follows training
    await session.close()
    client.close()


@pytest.mark.parametrize("sync", ["auto", "reload"])
async def test_a_server_that_cannot_take_weights_is_refused_when_the_engine_opens(
    plain: StubServer, tiny_model_dir: Path, tmp_path: Path, sync: str
) -> None:
    with pytest.raises(OpenAIServerError, match="VLLM_SERVER_DEV_MODE=1") as refused:
        await open_session(plain.url, tiny_model_dir, tmp_path, sync=sync)
    assert "set sync = 'none'" in "\n".join(refused.value.__notes__)


async def test_sync_none_samples_a_fixed_policy_and_reports_the_gap(
    plain: StubServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    client, session = await open_session(plain.url, tiny_model_dir, tmp_path, sync="none")
    await session.sync(4)  # nothing to load: never asks the server
    assert not [r for r in plain.requests if r[1] == "/collective_rpc"]
    assert session.engine.version == 3
    assert session.policy_gap(5) == {"sampler_steps_behind": 2.0}
    await session.close()
    client.close()
