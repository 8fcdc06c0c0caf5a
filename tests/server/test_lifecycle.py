"""Sessions end: `sessions/{id}/finish` (what the SDK's ServiceClient.close sends) and a missed
heartbeat unload the session's models and delete its snapshot samplers; named checkpoints stay.
Raw HTTP, so the test controls every request (the SDK would heartbeat on its own)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import KEY, ServerProcess, post, result, start_server

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [10, 72, 101]}]}


def new_session(server: ServerProcess) -> str:
    response = post(server, "create_session", json={})
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def new_model(server: ServerProcess, session: str, base_model: Path) -> str:
    body = {"session_id": session, "model_seq_id": 0, "base_model": str(base_model)}
    submitted = post(server, "create_model", json={**body, "lora_config": {"rank": 2}})
    return result(server, submitted.json()["request_id"])["model_id"]


def submit(server: ServerProcess, path: str, body: dict) -> dict:
    response = post(server, path, json=body)
    assert response.status_code == 200, response.text
    return result(server, response.json()["request_id"])


def optim_step(server: ServerProcess, model_id: str, seq_id: int) -> dict:
    return submit(
        server, "optim_step", {"model_id": model_id, "seq_id": seq_id, "adam_params": ADAM}
    )


def sample_body(sampler_id: str) -> dict:
    return {
        "sampling_session_id": sampler_id,
        "prompt": PROMPT,
        "sampling_params": {"max_tokens": 2},
    }


def sample(server: ServerProcess, sampler_id: str) -> dict:
    return submit(server, "asample", sample_body(sampler_id))


def wait_until_gone(path: Path) -> bool:
    """Directories are deleted on the server's admin thread, just after the unload."""
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def test_finish_unloads_models_and_deletes_snapshots(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    session = new_session(server)
    model_id = new_model(server, session, tiny_model_dir)
    assert "metrics" in optim_step(server, model_id, 1)
    named = submit(server, "save_weights", {"model_id": model_id, "seq_id": 2, "path": "kept"})[
        "path"
    ]
    snapshot = submit(server, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 3})
    sampler_id = snapshot["sampling_session_id"]
    assert len(sample(server, sampler_id)["sequences"]) == 1
    snapshot_dir = (
        server.storage
        / "runs"
        / model_id.replace(":", "_")
        / "sampler_weights"
        / f".ephemeral-{sampler_id}"
    )
    assert snapshot_dir.is_dir()

    finished = post(server, f"sessions/{session}/finish", json={"reason": {"type": "success"}})
    assert finished.status_code == 200 and finished.json() == {}
    # Finishing again is harmless; another key cannot finish it (it does not exist for them).
    assert post(server, f"sessions/{session}/finish", json={}).status_code == 200
    other = post(server, f"sessions/{session}/finish", "tml-test-key-two", json={})
    assert other.status_code == 404

    # The model is unloaded: its next request fails with a user error that says what to do.
    gone = optim_step(server, model_id, 4)
    assert gone["category"] == "user" and "not loaded" in gone["error"]
    assert "create a training client from one of its checkpoints" in gone["error"]
    # Its snapshot sampler's weights are deleted, and sampling it is refused with the 410 of a
    # finished session (before anything could reload and cache the weights).
    assert wait_until_gone(snapshot_dir)
    stale = post(server, "asample", json=sample_body(sampler_id))
    assert stale.status_code == 410 and "has finished" in stale.json()["detail"], stale.text
    # The session takes no new work, and its heartbeat answers 410 (the SDK stops beating).
    assert post(server, "session_heartbeat", json={"session_id": session}).status_code == 410
    refused = post(
        server,
        "create_model",
        json={"session_id": session, "model_seq_id": 1, "base_model": str(tiny_model_dir)},
    )
    assert refused.status_code == 410 and "finished" in refused.json()["detail"]

    # The named checkpoint outlives the session: a new session loads it and trains on.
    fresh = new_session(server)
    body = {"path": named, "session_id": fresh, "model_seq_id": 0, "optimizer": True}
    loaded = submit(server, "load_weights", body)
    assert loaded["path"] == named
    assert "metrics" in optim_step(server, loaded["model_id"], 1)
    run = httpx.get(f"{server.url}/api/v1/training_runs/{model_id}", headers={"X-API-Key": KEY})
    assert run.status_code == 200  # the run stays listed


def test_a_session_that_finishes_while_its_model_loads_keeps_no_model(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    busy, doomed = new_session(server), new_session(server)
    first = new_model(server, busy, tiny_model_dir)
    snapshot = submit(server, "save_weights_for_sampler", {"model_id": first, "seq_id": 1})
    # A long sampling call holds the server's one compute thread (seconds: 128 samples of up to
    # 500 tokens), so the model created next waits behind it while its session finishes,
    # whatever the machine's load.
    long_body = sample_body(snapshot["sampling_session_id"])
    long_body.update(num_samples=128, sampling_params={"max_tokens": 500, "seed": 0})
    blocker = post(server, "asample", json=long_body)
    assert blocker.status_code == 200, blocker.text
    body = {"session_id": doomed, "model_seq_id": 0, "base_model": str(tiny_model_dir)}
    second = post(server, "create_model", json={**body, "lora_config": {"rank": 2}})
    assert second.status_code == 200, second.text
    assert post(server, f"sessions/{doomed}/finish", json={}).status_code == 200
    assert len(result(server, blocker.json()["request_id"])["sequences"]) == 128
    failed = result(server, second.json()["request_id"])
    assert failed["category"] == "user", failed
    assert f"session {doomed} finished while model" in failed["error"]
    # Nothing of it is left: no training run is recorded (and no model is live to free).
    run = httpx.get(
        f"{server.url}/api/v1/training_runs/{second.json()['model_id']}",
        headers={"X-API-Key": KEY},
    )
    assert run.status_code == 404, run.text
    assert "metrics" in optim_step(server, first, 2)  # the other session's is live


def test_unload_model_frees_a_model_before_its_session_ends(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    tinker_types = pytest.importorskip("tinker").types
    session = new_session(server)
    model_id = new_model(server, session, tiny_model_dir)
    body = {"model_id": model_id, "seq_id": 1, "path": "before-unload"}
    named = submit(server, "save_weights", body)["path"]
    # Another key's model does not exist for this one.
    refused = post(server, "unload_model", "tml-test-key-two", json={"model_id": model_id})
    assert refused.status_code == 404

    unloaded = post(server, "unload_model", json={"model_id": model_id, "type": "unload_model"})
    assert unloaded.status_code == 200, unloaded.text
    answer = result(server, unloaded.json()["request_id"])
    # What the SDK's type of this future's result reads.
    assert tinker_types.UnloadModelResponse.model_validate(answer).model_id == model_id
    gone = optim_step(server, model_id, 2)
    assert gone["category"] == "user" and "not loaded" in gone["error"]
    again = post(server, "unload_model", json={"model_id": model_id})
    assert again.status_code == 200  # unloading twice is harmless
    # The session goes on, and the model's checkpoint outlives it.
    body = {"path": named, "session_id": session, "model_seq_id": 1, "optimizer": True}
    loaded = submit(server, "load_weights", body)
    assert "metrics" in optim_step(server, loaded["model_id"], 1)


def test_a_session_without_heartbeats_expires(tiny_model_dir: Path, tmp_path: Path) -> None:
    timeout = 2.0
    server = start_server(tiny_model_dir, tmp_path / "storage", "--session-timeout", str(timeout))
    beating: set[str] = set()
    stop = threading.Event()

    def heartbeats() -> None:  # what the SDK does every 10 s, here every 0.2 s
        while not stop.wait(0.2):
            for session in list(beating):
                post(server, "session_heartbeat", json={"session_id": session})

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        silent, kept = new_session(server), new_session(server)
        beating.update((silent, kept))  # both beat while their models load
        silent_model = new_model(server, silent, tiny_model_dir)
        kept_model = new_model(server, kept, tiny_model_dir)
        beating.discard(silent)
        # The reaper looks every timeout/2: after 2.5 timeouts of silence the session is gone.
        time.sleep(2.5 * timeout)
        expired = optim_step(server, silent_model, 1)
        assert expired["category"] == "user" and "not loaded" in expired["error"]
        assert post(server, "session_heartbeat", json={"session_id": silent}).status_code == 410
        assert "metrics" in optim_step(server, kept_model, 1)  # heartbeats kept it loaded
    finally:
        stop.set()
        thread.join()
        server.stop()
