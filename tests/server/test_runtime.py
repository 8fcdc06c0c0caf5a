"""The runtime's background work, in process: the session reaper outlives a failing iteration,
failures nobody waits for are logged, and forward outputs are decoded to JSON off the event
loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sqlite3
import time
import uuid
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from posttrain.server import tinker_api
from posttrain.server.app import create_app
from posttrain.server.config import ServerConfig, owner_of
from posttrain.server.proto import encode_forward_backward_output, forward_backward_output_json
from posttrain.types import ForwardBackwardOutput

KEY = "tml-runtime-test"
HEADERS = {"X-API-Key": KEY}


def config(tiny_model_dir: Path, tmp_path: Path, **changes: float | bool) -> ServerConfig:
    return ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
        **changes,  # pyright: ignore[reportArgumentType]
    )


def wait_for(condition, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.02)


def test_the_session_reaper_survives_a_failing_iteration(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(config(tiny_model_dir, tmp_path, session_timeout=0.4))
    runtime = app.state.runtime
    store = runtime.store
    real_expire = store.expire_sessions
    calls: list[float] = []

    def locked_once(cutoff: float) -> list[str]:  # what a busy database does now and then
        calls.append(cutoff)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database is locked")
        return real_expire(cutoff)

    store.expire_sessions = locked_once
    with caplog.at_level(logging.ERROR), TestClient(app) as client:
        session = client.post("/api/v1/create_session", json={}, headers=HEADERS)
        session_id = session.json()["session_id"]
        # The reaper looks every 0.2 s: it fails once, then expires the silent session.
        wait_for(lambda: store.session_state(session_id, owner_of(KEY)) == "finished", "expiry")
        answer = client.post(
            "/api/v1/session_heartbeat", json={"session_id": session_id}, headers=HEADERS
        )
    assert answer.status_code == 410
    assert len(calls) >= 2
    failures = [r for r in caplog.records if "expiring sessions failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert "database is locked" in str(failures[0].exc_info[1])


def test_background_failures_are_logged(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(config(tiny_model_dir, tmp_path))
    runtime = app.state.runtime
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def fails() -> None:
        raise OSError("disk gone")

    with caplog.at_level(logging.ERROR):
        runtime.background(pool, "deleting /some/dir", fails)
        runtime.background(pool, "closing model m", lambda: None)
        pool.shutdown(wait=True)  # done callbacks run in the pool's thread before it exits
    logged = [r for r in caplog.records if r.name == "posttrain.server.runtime"]
    assert [r.getMessage() for r in logged] == ["deleting /some/dir failed"]
    assert logged[0].exc_info is not None and str(logged[0].exc_info[1]) == "disk gone"


def test_forward_outputs_are_decoded_off_the_event_loop(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = [{"logprobs": torch.tensor([-0.5, -1.25, -3.0])}]
    proto = encode_forward_backward_output(
        ForwardBackwardOutput("ArrayRecord", outputs, {"loss:sum": 4.75})
    )
    on_loop: list[bool] = []

    def decode(body: bytes) -> dict[str, object]:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread
            on_loop.append(False)
        return forward_backward_output_json(body)

    monkeypatch.setattr(tinker_api, "forward_backward_output_json", decode)
    app = create_app(config(tiny_model_dir, tmp_path))
    store = app.state.runtime.store
    request_id = uuid.uuid4().hex
    store.add_future(request_id, owner_of(KEY), "forward", "digest")
    store.complete_future(request_id, None, proto)  # a forward pass stores only its protobuf
    with TestClient(app) as client:
        answer = client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=HEADERS
        )
    assert answer.status_code == 200
    assert answer.json() == forward_backward_output_json(proto)
    assert on_loop == [False]


def test_serve_packing_makes_every_training_model_pack(tiny_model_dir: Path, tmp_path: Path):
    # `posttrain serve --packing`: the Tinker wire cannot ask for packing per call, so the
    # server packs every training model's passes (TinkerBackend refuses `packing=` itself).
    lora: dict[str, int | bool] = {
        "rank": 4, "train_attn": True, "train_mlp": True, "train_unembed": False,
    }  # fmt: skip
    for packing in (True, False):
        app = create_app(config(tiny_model_dir, tmp_path / str(packing), packing=packing))
        runtime = app.state.runtime
        client = runtime.build_client("m", lora, 0)
        assert [w.config.packing for w in client.dispatch.executor.workers] == [packing]
        client.close()
        runtime.close()
