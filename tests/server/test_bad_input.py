"""Bad input against a real `posttrain serve`: every error has the shape the SDK expects, and the
server keeps serving. httpx sends what the SDK cannot produce."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import KEY, OTHER_KEY, ServerProcess, start_server

tinker = pytest.importorskip("tinker")
types = tinker.types
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

GAP_TIMEOUT = 2.0
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    storage = tmp_path_factory.mktemp("serve-bad") / "storage"
    extra = ("--seq-gap-timeout", str(GAP_TIMEOUT), "--max-body-mb", str(MAX_BODY / 2**20))
    process = start_server(tiny_model_dir, storage, *extra)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> object:
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def post(server: ServerProcess, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = dict(kwargs.pop("headers", {}))
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.post(f"{server.url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def detail(response: httpx.Response) -> str:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return str(response.json()["detail"])


def new_model(service, tiny_model_dir: Path):
    return service.create_lora_training_client(base_model=str(tiny_model_dir), rank=2).result()


def datum(tokens: list[int]):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def fwdbwd_body(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum(tokens)], loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def result(server: ServerProcess, request_id: str, key: str = KEY) -> dict:
    while True:
        response = post(server, "retrieve_future", key, json={"request_id": request_id})
        assert response.status_code == 200, response.text
        body = response.json()
        if body.get("type") != "try_again":
            return body


def test_api_keys(server: ServerProcess) -> None:
    assert detail(post(server, "create_session", None, json={})).startswith("missing API key")
    for bad in ("tml-not-configured", "sk-not-tinker"):
        response = post(server, "create_session", bad, json={})
        assert response.status_code == 401 and detail(response) == "invalid API key"
    # OpenAI clients send the key as a bearer token.
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.url}/healthz", headers=bearer).status_code == 200
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").get_server_capabilities()


def test_malformed_bodies(server: ServerProcess) -> None:
    garbage = post(server, "forward_backward", content=b"\xff\x01not a protobuf")
    assert garbage.status_code == 400 and "protobuf" in detail(garbage)
    broken = post(
        server, "create_session", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 422 and broken.json()["detail"]
    missing = post(server, "create_model", json={"session_id": "x"})
    assert missing.status_code == 422 and missing.json()["detail"]


def test_unknown_and_foreign_ids(server: ServerProcess, service, tiny_model_dir: Path) -> None:
    tc = new_model(service, tiny_model_dir)
    mine = post(server, "get_info", json={"model_id": tc.model_id})
    assert mine.status_code == 200 and mine.json()["model_id"] == tc.model_id
    unknown = post(server, "get_info", json={"model_id": "session-none:train:0"})
    foreign = post(server, "get_info", OTHER_KEY, json={"model_id": tc.model_id})
    assert unknown.status_code == foreign.status_code == 404
    # The other key learns nothing beyond what an unknown id tells.
    assert detail(foreign) == detail(unknown).replace("session-none:train:0", tc.model_id)
    body = fwdbwd_body(tc.model_id, 1, [1, 2, 3])
    assert post(server, "forward_backward", OTHER_KEY, content=body).status_code == 404
    runs = httpx.get(f"{server.url}/api/v1/training_runs", headers={"X-API-Key": OTHER_KEY})
    assert tc.model_id not in runs.text
    run = httpx.get(
        f"{server.url}/api/v1/training_runs/{tc.model_id}", headers={"X-API-Key": OTHER_KEY}
    )
    assert run.status_code == 404 and detail(run)

    submitted = post(server, "forward_backward", content=body)
    request_id = submitted.json()["request_id"]
    assert (
        post(server, "retrieve_future", OTHER_KEY, json={"request_id": request_id}).status_code
        == 404
    )
    assert "metrics" in result(server, request_id)
    gone = post(server, "retrieve_future", json={"request_id": "no-such-request"})
    assert gone.status_code == 404 and detail(gone)


def test_token_ids_out_of_range(service, tiny_model_dir: Path) -> None:
    tc = new_model(service, tiny_model_dir)
    with pytest.raises(tinker.RequestFailedError) as failed:
        tc.forward_backward([datum([1, 2, 1_000_000])], "cross_entropy").result()
    assert failed.value.category == "user" and "outside the vocabulary" in failed.value.message
    # Nothing was accumulated by the failed call, and the model keeps working.
    assert tc.forward([datum([1, 2, 3])], "cross_entropy").result().metrics["loss:sum"] > 0


def test_oversize_body(server: ServerProcess) -> None:
    big = post(server, "forward_backward", content=b"\x00" * (MAX_BODY + 1))
    assert big.status_code == 413 and "limit" in detail(big)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams
        for _ in range(8):
            yield b"\x00" * (MAX_BODY // 4)

    streamed = post(server, "forward_backward", content=chunks())
    assert streamed.status_code == 413 and "limit" in detail(streamed)


def test_seq_id_gap_fails_within_timeout(
    server: ServerProcess, service, tiny_model_dir: Path
) -> None:
    tc = new_model(service, tiny_model_dir)
    other = new_model(service, tiny_model_dir)
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    start = time.monotonic()
    submitted = post(
        server, "optim_step", json={"model_id": tc.model_id, "seq_id": 3, "adam_params": adam}
    )
    # Another model is not held up by the gap.
    assert other.forward([datum([1, 2, 3])], "cross_entropy").result().metrics["loss:sum"] > 0
    failed = result(server, submitted.json()["request_id"])
    waited = time.monotonic() - start
    assert failed["category"] == "user" and "seq_id 1 never arrived" in failed["error"]
    assert GAP_TIMEOUT <= waited < GAP_TIMEOUT + 3


def test_idempotent_submission(server: ServerProcess, service, tiny_model_dir: Path) -> None:
    tc = new_model(service, tiny_model_dir)
    body = {"model_id": tc.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first = post(server, "optim_step", json=body).json()["request_id"]
    assert post(server, "optim_step", json=body).json()["request_id"] == first
    body["adam_params"] = {"learning_rate": 1.0}
    changed = post(server, "optim_step", json=body)
    assert changed.status_code == 409 and "different payload" in detail(changed)
    assert "metrics" in result(server, first)


def test_non_loopback_without_key_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "posttrain.cli.main",
        "serve",
        "--base-model",
        str(tiny_model_dir),
    ]
    args += ["--host", "0.0.0.0", "--storage", str(tmp_path)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "non-loopback" in done.stderr and "--api-key" in done.stderr
