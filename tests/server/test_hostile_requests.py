"""Requests that once got a 500 from a real `posttrain serve`, each now a 4xx that names the
field; a zstd bomb refused within the body limit; errors that name the client's checkpoints, never
the server's storage paths. Raw HTTP sends what the SDK cannot produce."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np
import pytest
from serve_helpers import KEY, ServerProcess, post, result

from posttrain.server import proto_schema

if TYPE_CHECKING:
    from tinker import ServiceClient

tinker = pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def model(server: ServerProcess, tiny_model_dir: Path) -> dict[str, str]:
    session = post(server, "create_session", json={}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": str(tiny_model_dir)}
    created = result(server, post(server, "create_model", json=create).json()["request_id"])
    return {"session_id": session, "model_id": created["model_id"], "base": str(tiny_model_dir)}


def send(server: ServerProcess, path: str, body: str | bytes, **headers: str) -> httpx.Response:
    headers = {"X-API-Key": KEY, "content-type": "application/json", **headers}
    content = body.encode() if isinstance(body, str) else body
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def negative_token_protobuf(model_id: str) -> bytes:
    msg = proto_schema.new_message("ForwardBackwardRequest")
    msg.model_id, msg.seq_id, msg.loss_fn = model_id, 1, "cross_entropy"
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, -5, 3], "<i4").tobytes()
    return msg.SerializeToString()


# (what, route, body with {model_id}/{session_id}/{base} filled in, status, text in the answer)
CASES = [
    (
        "seq_id above 2**63",
        "/api/v1/optim_step",
        '{"model_id": "{model_id}", "seq_id": 18446744073709551616, "adam_params": {}}',
        422,
        "seq_id",
    ),
    ("lone surrogate in an id", "/api/v1/get_info", '{"model_id": "\\ud800"}', 422, "model_id"),
    (
        "lone surrogate in a model name",
        "/v1/completions",
        '{"model": "\\ud800", "prompt": "hi"}',
        400,
        "model",
    ),
    (
        "negative token id in asample",
        "/api/v1/asample",
        '{"base_model": "{base}", "prompt": {"chunks": [{"tokens": [1, -1]}]}}',
        422,
        "prompt.chunks.0.tokens.1",
    ),
    ("deep JSON to completions", "/v1/completions", DEEP, 400, "nests too deeply"),
    (
        "deep JSON to chat",
        "/v1/chat/completions",
        '{"model": "{base}", "messages": ' + DEEP + "}",
        400,
        "nests too deeply",
    ),
    (
        "huge LoRA seed",
        "/api/v1/create_model",
        '{"session_id": "{session_id}", "model_seq_id": 9, "base_model": "{base}", '
        '"lora_config": {"seed": 1180591620717411303424}}',
        422,
        "lora_config.seed",
    ),
    (
        "string learning rate",
        "/api/v1/optim_step",
        '{"model_id": "{model_id}", "seq_id": 1, "adam_params": {"learning_rate": "fast"}}',
        422,
        "adam_params.learning_rate",
    ),
    (
        "infinite learning rate",
        "/api/v1/optim_step",
        '{"model_id": "{model_id}", "seq_id": 1, "adam_params": {"learning_rate": Infinity}}',
        422,
        "adam_params.learning_rate: Input should be a finite number",
    ),
    (
        "infinite temperature",
        "/api/v1/asample",
        '{"base_model": "{base}", "prompt": {"chunks": [{"tokens": [1]}]}, '
        '"sampling_params": {"temperature": Infinity}}',
        422,
        "sampling_params.temperature",
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "status", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_once_a_500_now_a_4xx_naming_the_field(
    server: ServerProcess, model: dict[str, str], route: str, body: str, status: int, text: str
) -> None:
    for key, value in model.items():
        body = body.replace("{" + key + "}", value)
    response = send(server, route, body)
    assert response.status_code == status, response.text
    assert text in response.text


def test_negative_token_id_in_a_protobuf(server: ServerProcess, model: dict[str, str]) -> None:
    body = negative_token_protobuf(model["model_id"])
    response = send(server, "/api/v1/forward_backward", body, **{"content-type": "x-protobuf"})
    assert response.status_code == 400
    assert "datum 0: EncodedTextChunk.tokens[1] is -5" in response.json()["detail"]


def peak_memory_bytes(pid: int) -> int:
    """The process's peak resident memory (VmHWM) so far."""
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_zstd_bomb_is_refused_within_the_body_limit(
    server: ServerProcess, model: dict[str, str]
) -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30))  # 1 GiB of zeros: ~32 KB
    assert len(bomb) < 64 * 1024
    before = peak_memory_bytes(server.process.pid)
    headers = {"content-type": "application/x-protobuf", "content-encoding": "zstd"}
    response = send(server, "/api/v1/forward_backward", bomb, **headers)
    assert response.status_code == 413
    assert "inflates beyond the server's limit of 67108864 bytes" in response.json()["detail"]
    # Inflating stops at the 64 MiB limit (the whole GiB once was allocated); the bytearray's
    # growth margin and allocator slack stay far below 256 MiB.
    assert peak_memory_bytes(server.process.pid) - before < 256 * 2**20


def test_errors_name_the_clients_checkpoints_not_server_paths(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as service:
        check_errors_name_the_clients_paths(server, service, tiny_model_dir)


def check_errors_name_the_clients_paths(
    server: ServerProcess, service: ServiceClient, tiny_model_dir: Path
) -> None:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()
    state = tc.save_state("damaged").result().path
    sampler = tc.save_weights_for_sampler("gone").result().path
    # Behind the server's back: the adapter of one is lost, the other's folder deleted.
    (server.checkpoint_dir(state) / "adapter_model.safetensors").unlink()
    shutil.rmtree(server.checkpoint_dir(state).parent.parent / "sampler_weights" / "gone")
    with pytest.raises(tinker.RequestFailedError) as load:
        service.create_training_client_from_state(state).result()
    sampling = service.create_sampling_client(model_path=sampler)
    with pytest.raises(tinker.RequestFailedError) as sample:
        prompt = tinker.types.ModelInput.from_ints([1, 2])
        sampling.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=2)).result()
    for error, path in ((load.value, state), (sample.value, sampler)):
        message = str(error)
        assert path in message, message
        assert str(server.storage) not in message and str(server.storage.resolve()) not in message
