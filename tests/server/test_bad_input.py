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
from serve_helpers import KEY, OTHER_KEY, ServerProcess, post, result, start_server

tinker = pytest.importorskip("tinker")
types = tinker.types
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

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
def service(server: ServerProcess) -> Iterator[object]:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result()


def detail(response: httpx.Response) -> str:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return str(response.json()["detail"])


def new_model(service, tiny_model_dir: Path, seed: int | None = None):
    base = str(tiny_model_dir)
    return service.create_lora_training_client(base_model=base, rank=2, seed=seed).result()


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


def test_api_keys(server: ServerProcess) -> None:
    assert detail(post(server, "create_session", None, json={})).startswith("missing API key")
    for bad in ("tml-not-configured", "sk-not-tinker"):
        response = post(server, "create_session", bad, json={})
        assert response.status_code == 401 and detail(response) == "invalid API key"
    # OpenAI clients send the key as a bearer token.
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server.url}/healthz", headers=bearer).status_code == 200
    with (
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong") as wrong,
        pytest.raises(tinker.AuthenticationError),
    ):
        wrong.get_server_capabilities()


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
    failing = new_model(service, tiny_model_dir, seed=5)
    clean = new_model(service, tiny_model_dir, seed=5)  # the same initial weights
    good = datum([10, 72, 101, 108, 108, 111])
    with pytest.raises(tinker.RequestFailedError) as failed:
        # A valid datum first: had the server run it before refusing the second, its gradient
        # would stay accumulated.
        failing.forward_backward([good, datum([1, 2, 1_000_000])], "cross_entropy").result()
    assert failed.value.category == "user" and "outside the vocabulary" in failed.value.message
    # Nothing was accumulated: the next step's gradient is the clean model's (a leftover copy of
    # `good`'s gradient would double its norm), and so are the weights after it. Same process,
    # same code and inputs: equal up to float32 rounding (measured equal).
    adam = types.AdamParams(learning_rate=1e-2)
    norms, losses = [], []
    for tc in (failing, clean):
        tc.forward_backward([good], "cross_entropy").result()
        norms.append(tc.optim_step(adam).result().metrics["grad_norm:mean"])
        losses.append(tc.forward([good], "cross_entropy").result().metrics["loss:sum"])
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 0
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_another_keys_checkpoints_are_refused(
    server: ServerProcess, service, tiny_model_dir: Path
) -> None:
    tc = new_model(service, tiny_model_dir)
    weights = tc.save_state("private").result().path
    sampler = tc.save_weights_for_sampler("private").result().path
    session = post(server, "create_session", OTHER_KEY, json={}).json()["session_id"]
    intruder = post(
        server,
        "create_model",
        OTHER_KEY,
        json={"session_id": session, "model_seq_id": 0, "base_model": str(tiny_model_dir)},
    )
    intruder_model = result(server, intruder.json()["request_id"], OTHER_KEY)["model_id"]

    def refused(path: str) -> list[httpx.Response]:
        first_request = {"path": path, "session_id": session, "model_seq_id": 1}
        existing = {"path": path, "model_id": intruder_model, "seq_id": 1}
        sampling = {"session_id": session, "sampling_session_seq_id": 0, "model_path": path}
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
        return [
            post(server, "load_weights", OTHER_KEY, json=first_request),
            post(server, "load_weights", OTHER_KEY, json={**existing, "optimizer": True}),
            post(server, "create_sampling_session", OTHER_KEY, json=sampling),
            post(server, "asample", OTHER_KEY, json={"model_path": path, "prompt": prompt}),
            post(server, "weights_info", OTHER_KEY, json={"tinker_path": path}),
        ]

    unknown = refused("tinker://session-none:train:0/weights/nothing")
    for path in (weights, sampler):
        # Answered exactly as a path that does not exist: the other key learns nothing.
        for mine, absent in zip(refused(path), unknown, strict=True):
            assert mine.status_code == absent.status_code == 404
            assert detail(mine) == detail(absent).replace(
                "tinker://session-none:train:0/weights/nothing", path
            )
    with (
        tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY) as other,
        pytest.raises(tinker.NotFoundError),
    ):
        other.create_training_client_from_state(weights).result()
    # The owner still loads both.
    assert service.create_training_client_from_state(weights).result().model_id
    assert (
        service.create_sampling_client(model_path=sampler)
        .compute_logprobs(types.ModelInput.from_ints([1, 2, 3]))
        .result()[1:]
    )


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


def test_max_resident_adapters_below_one_is_refused(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "posttrain.cli.main", "serve", "--base-model", "tiny"]
    args += ["--storage", str(tmp_path), "--max-resident-adapters", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--max-resident-adapters must be >= 1" in done.stderr
    assert "got 0; leave it out for no limit" in done.stderr
