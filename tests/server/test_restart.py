"""SIGKILL `posttrain serve` after a save, start it again on the same --db and --storage: finished
futures are still answered, pending ones fail, checkpoints are listed and loadable, training
continues."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from serve_helpers import KEY, start_server

tinker = pytest.importorskip("tinker")
types = tinker.types

# Each test talks to a `posttrain serve` subprocess (seconds to start, more on a busy CPU).
pytestmark = pytest.mark.slow

TOKENS = [10, 72, 101, 108, 108, 111, 33]


def data():
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
        )
    ]


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}/api/v1/{path}", json=body, headers={"X-API-Key": KEY}, timeout=40)
    assert response.status_code == 200, response.text
    return response.json()


def test_restart_keeps_futures_and_checkpoints(tiny_model_dir: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    first = start_server(tiny_model_dir, storage)
    service = tinker.ServiceClient(base_url=first.url, api_key=KEY)
    try:
        # A fixed LoRA seed: with a random one, 3 AdamW steps at 1e-2 once raised the loss
        # (28.7 -> 36.2), an unlucky start rather than a resume fault.
        tc = service.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=4, seed=0
        ).result()
        tc.forward_backward(data(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # seq_ids 1, 2
        path = tc.save_state("before-crash").result().path  # seq_id 3
        loss_at_save = tc.forward(data(), "cross_entropy").result().metrics["loss:sum"]  # seq_id 4
        # A finished future, and one left pending behind a seq_id gap (6 is never sent).
        done = post(first.url, "optim_step", {"model_id": tc.model_id, "seq_id": 5})["request_id"]
        pending = post(first.url, "optim_step", {"model_id": tc.model_id, "seq_id": 7})
        done_answer = post(first.url, "retrieve_future", {"request_id": done})
        assert done_answer == {"metrics": done_answer["metrics"], "type": "optim_step"}
    finally:
        first.kill()
        # Not waited for: the SDK retries the session's finish request against the dead server
        # for minutes, then stops the session's heartbeats, which would otherwise retry it for
        # the rest of the test run.
        service.close("interrupted")

    second = start_server(tiny_model_dir, storage)
    try:
        assert post(second.url, "retrieve_future", {"request_id": done}) == done_answer
        lost = post(second.url, "retrieve_future", {"request_id": pending["request_id"]})
        assert lost["category"] == "server" and "restarted" in lost["error"]

        rest = tinker.RestClient(base_url=second.url, api_key=KEY)
        listed = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert [c.tinker_path for c in listed] == [path]

        service = tinker.ServiceClient(base_url=second.url, api_key=KEY)
        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        # The checkpoint holds exactly the weights the first server had after seq_id 3.
        assert resumed.forward(data(), "cross_entropy").result().metrics["loss:sum"] == loss_at_save
        losses = []
        for _ in range(3):
            losses.append(
                resumed.forward_backward(data(), "cross_entropy").result().metrics["loss:sum"]
            )
            resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert losses[0] == loss_at_save and losses[-1] < losses[0]
        # The model that lived in the killed process is known but no longer loaded.
        stale = post(second.url, "optim_step", {"model_id": tc.model_id, "seq_id": 8})
        answer = post(second.url, "retrieve_future", {"request_id": stale["request_id"]})
        assert answer["category"] == "user" and "not loaded" in answer["error"]
        service.close("success").result()
    finally:
        second.stop()
