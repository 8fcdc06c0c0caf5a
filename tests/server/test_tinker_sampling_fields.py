"""posttrain serve's Tinker `asample` takes SamplingParams' fields beyond the SDK's (min_p and the
penalties) as extra `sampling_params` keys, and samples what posttrain's sampler samples with
them; a value out of range is a 400 naming the field. In process (FastAPI's TestClient)."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.testclient import TestClient

from posttrain.engine.decode.sampler import Sampler
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.server.app import create_app
from posttrain.server.config import ServerConfig
from posttrain.types import SamplingParams

HEADERS = {"X-API-Key": "tml-any"}
PROMPT = [10, 72, 101, 108]
EXTRA = {"min_p": 0.05, "repetition_penalty": 1.5, "presence_penalty": 1.0}


def _sample(client: TestClient, sampler_id: str, params: dict[str, object]) -> list[list[int]]:
    body = {
        "sampling_session_id": sampler_id,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": params,
    }
    submitted = client.post("/api/v1/asample", json=body, headers=HEADERS)
    assert submitted.status_code == 200, submitted.text
    request = {"request_id": submitted.json()["request_id"]}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = client.post("/api/v1/retrieve_future", json=request, headers=HEADERS).json()
        if done.get("type") != "try_again":
            return [s["tokens"] for s in done["sequences"]]
    raise AssertionError("the sample did not finish in 60 s")


def test_asample_honours_min_p_and_penalties(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
    )
    with TestClient(create_app(config)) as client:
        session = client.post("/api/v1/create_session", json={}, headers=HEADERS).json()
        created = client.post(
            "/api/v1/create_sampling_session",
            json={
                "session_id": session["session_id"],
                "sampling_session_seq_id": 0,
                "base_model": "tiny",
            },
            headers=HEADERS,
        )
        assert created.status_code == 200, created.text
        sampler_id = created.json()["sampling_session_id"]
        base = {"max_tokens": 10, "seed": 4, "stop": []}
        got = _sample(client, sampler_id, {**base, **EXTRA})
        plain = _sample(client, sampler_id, base)
        refused = client.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sampler_id,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": 2, "frequency_penalty": 3.0},
            },
            headers=HEADERS,
        )
    sampler = Sampler(
        load_hf_model(tiny_model_dir, dtype="float32"), load_tokenizer(tiny_model_dir)
    )
    params = SamplingParams(max_tokens=10, seed=4, stop=[], **EXTRA)  # pyright: ignore[reportArgumentType]
    expected = [s.tokens for s in sampler.sample([PROMPT], 2, params)[0].sequences]
    assert got == expected != plain
    assert refused.status_code == 400
    assert "SamplingParams.frequency_penalty must be in [-2, 2], got 3.0" in refused.text
