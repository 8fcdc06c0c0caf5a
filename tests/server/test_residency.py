"""`server.residency` in process: a training client spilled between forward_backward and
optim_step comes back bit-exact (adapter, AdamW moments and step, gradients), the least
recently used idle adapter leaves first, and a request that cannot fit gets a clear error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from serve_helpers import assert_bit_equal, in_process_config

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.compute_thread import ComputeThread
from posttrain.engine.executor import InProcessExecutor
from posttrain.engine.worker import Worker
from posttrain.server.app import create_app
from posttrain.server.residency import NoRoomError, Residency, Unloaded
from posttrain.types import AdamParams, Datum, ModelInput

TOKENS = [[10, 72, 101, 108, 108, 111], [10, 87, 111, 114, 108, 100, 33, 33]]
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)


def data() -> list[Datum]:
    return [
        Datum(
            model_input=ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
        )
        for t in TOKENS
    ]


@pytest.fixture
def compute() -> Iterator[ComputeThread]:
    thread = ComputeThread("test-compute")
    yield thread
    thread.close()


def builder(model_dir: Path, storage: Path, compute: ComputeThread, seed: int):
    def build() -> LocalTrainingClient:
        return create_training_client(
            str(model_dir), lora_rank=4, seed=seed, storage_dir=storage, compute_thread=compute
        )

    return build


def worker(client: LocalTrainingClient) -> Worker:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    return executor.workers[0]


def state(client: LocalTrainingClient) -> dict[str, object]:
    """Everything a client's next results depend on, copied: adapter, gradients, AdamW."""
    w = worker(client)
    params = w.trainable_parameters()
    optim = w.optimizer.state_dict()
    return {
        "weights": {n: p.detach().clone() for n, p in params.items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params.items()},
        # By name: a rebuilt optimizer numbers the same parameters the same way, but say so.
        "moments": {
            name: {k: v.clone() for k, v in optim["state"][i].items()}
            for i, name in enumerate(params)
            if i in optim["state"]
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]],
    }


def add(residency: Residency, model_id: str, build) -> LocalTrainingClient:
    client = residency.create(model_id, build)
    residency.release(model_id)  # what Runtime.add_model does once the model is registered
    return client


def use(residency: Residency, model_id: str) -> LocalTrainingClient:
    with residency.using(model_id):
        return residency.client(model_id)


def test_a_spilled_client_reloads_bit_exact_with_its_gradients(
    tiny_model_dir: Path, tmp_path: Path, compute: ComputeThread
) -> None:
    residency = Residency(1, tmp_path / "spill", compute)
    a = add(residency, "a", builder(tiny_model_dir, tmp_path / "a", compute, seed=1))
    a.forward_backward(data(), "cross_entropy").result()
    a.optim_step(ADAM).result()  # AdamW moments and step 1
    a.forward_backward(data(), "cross_entropy").result()  # gradients waiting for a step
    before = state(a)
    assert all(g is not None for g in before["grads"].values())  # pyright: ignore[reportAttributeAccessIssue]

    add(residency, "b", builder(tiny_model_dir, tmp_path / "b", compute, seed=2))
    assert residency.resident() == ["b"] and residency.spills == 1
    assert (tmp_path / "spill" / "a").is_dir()

    again = use(residency, "a")  # b leaves for it
    assert again is not a and residency.resident() == ["a"] and residency.reloads == 1
    assert not (tmp_path / "spill" / "a").exists()  # the memory copy is the state now
    assert_bit_equal(state(again), before)
    step = worker(again).optimizer.state_dict()["state"][0]["step"]
    assert float(step) == 1.0

    # The next step matches a client that never left: the same calls on a twin.
    twin = builder(tiny_model_dir, tmp_path / "twin", compute, seed=1)()
    twin.forward_backward(data(), "cross_entropy").result()
    twin.optim_step(ADAM).result()
    twin.forward_backward(data(), "cross_entropy").result()
    assert_bit_equal(state(twin), before)
    again.optim_step(ADAM).result()
    twin.optim_step(ADAM).result()
    assert_bit_equal(state(again), state(twin))
    twin.close()


def test_the_least_recently_used_idle_adapter_leaves_first(
    tiny_model_dir: Path, tmp_path: Path, compute: ComputeThread
) -> None:
    residency = Residency(2, tmp_path / "spill", compute)
    for name in ("a", "b"):
        add(residency, name, builder(tiny_model_dir, tmp_path / name, compute, seed=0))
    use(residency, "a")  # b is the least recently used now
    dropped: list[str] = []
    residency.admit_sampler("sampler:x", lambda: dropped.append("x"))
    assert residency.resident() == ["a", "sampler:x"]
    with residency.using("b"):  # b comes back; a is least recently used and idle
        residency.client("b")
        assert residency.resident() == ["sampler:x", "b"]
        assert dropped == []
        residency.admit_sampler("sampler:y", lambda: dropped.append("y"))
        assert dropped == ["x"]  # the sampler leaves, not b, which is busy
        assert residency.resident() == ["b", "sampler:y"]


def test_a_request_that_cannot_fit_gets_a_clear_error(
    tiny_model_dir: Path, tmp_path: Path, compute: ComputeThread
) -> None:
    residency = Residency(1, tmp_path / "spill", compute, wait_s=0.3)
    add(residency, "a", builder(tiny_model_dir, tmp_path / "a", compute, seed=0))
    b_build = builder(tiny_model_dir, tmp_path / "b", compute, seed=0)
    with residency.using("a"):  # a's request is running: a cannot leave
        with pytest.raises(NoRoomError, match=r"--max-resident-adapters 1\).*larger"):
            residency.create("b", b_build)
        with pytest.raises(NoRoomError, match="all 1 resident adapters are busy"):
            compute.call(residency.admit_sampler, "sampler:x", lambda: None)
    assert residency.resident() == ["a"]
    add(residency, "b", b_build)  # once a is idle, b fits
    assert residency.resident() == ["b"]
    with pytest.raises(Unloaded):
        use(residency, "c")


def test_a_reload_waits_for_a_busy_adapter_to_finish(
    tiny_model_dir: Path, tmp_path: Path, compute: ComputeThread
) -> None:
    residency = Residency(1, tmp_path / "spill", compute, wait_s=30)
    add(residency, "a", builder(tiny_model_dir, tmp_path / "a", compute, seed=0))
    add(residency, "b", builder(tiny_model_dir, tmp_path / "b", compute, seed=0))
    pinned, done = threading.Event(), threading.Event()

    def busy_b() -> None:
        with residency.using("b"):
            residency.client("b")
            pinned.set()
            done.wait(10)

    thread = threading.Thread(target=busy_b)
    thread.start()
    pinned.wait(10)
    threading.Timer(0.3, done.set).start()  # b's request finishes a moment later
    use(residency, "a")  # waits for it, then b leaves
    thread.join()
    assert residency.resident() == ["a"]


def test_unlimited_keeps_everything_and_spills_nothing(
    tiny_model_dir: Path, tmp_path: Path, compute: ComputeThread
) -> None:
    residency = Residency(None, tmp_path / "spill", compute)
    for name in ("a", "b", "c"):
        add(residency, name, builder(tiny_model_dir, tmp_path / name, compute, seed=0))
    assert residency.resident() == ["a", "b", "c"] and residency.spills == 0
    client = residency.forget("b")
    assert client is not None
    client.close()
    assert residency.resident() == ["a", "c"]


def test_the_server_answers_a_request_that_cannot_fit_and_stays_up(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    app = create_app(in_process_config(tiny_model_dir, tmp_path, max_resident_adapters=1))
    runtime = app.state.runtime
    runtime.residency.wait_s = 0.3
    headers = {"X-API-Key": "tml-residency-test"}
    with TestClient(app) as http:

        def submit(path: str, body: dict[str, object]) -> dict[str, object]:
            answer = http.post(f"/api/v1/{path}", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            request_id = answer.json()["request_id"]
            while True:
                got = http.post(
                    "/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers
                )
                if got.json().get("type") != "try_again":
                    return got.json()

        session = http.post("/api/v1/create_session", json={}, headers=headers).json()["session_id"]
        body = {"session_id": session, "base_model": "tiny", "lora_config": {"rank": 2}}
        first = submit("create_model", {**body, "model_seq_id": 0})["model_id"]
        assert isinstance(first, str)
        saved = submit("save_weights_for_sampler", {"model_id": first, "path": "s", "seq_id": 1})
        with runtime.residency.using(first):  # a request of the first model is running
            refused = submit("create_model", {**body, "model_seq_id": 1})
            completion = {"model": saved["path"], "prompt": "hi", "max_tokens": 2}
            busy = http.post("/v1/completions", json=completion, headers=headers)
        assert refused["category"] == "user"
        assert "all 1 resident adapters are busy" in str(refused["error"])
        assert "--max-resident-adapters" in str(refused["error"])
        assert busy.status_code == 503
        assert "--max-resident-adapters 1" in busy.json()["error"]["message"]
        # Still up: the first model trains, and a second fits once the first is idle (it is
        # spilled for it).
        step = {"model_id": first, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
        assert submit("optim_step", step)["type"] == "optim_step"
        assert submit("create_model", {**body, "model_seq_id": 2})["type"] == "create_model"
        assert runtime.residency.spills == 1


def test_the_flag_is_checked() -> None:
    with pytest.raises(ValueError, match=r"--max-resident-adapters must be >= 1.*got 0"):
        in_process_config(Path("tiny"), Path("."), max_resident_adapters=0)


def test_a_spill_that_fails_keeps_the_client_in_memory(
    tiny_model_dir: Path, tmp_path: Path, compute: ComputeThread
) -> None:
    residency = Residency(1, tmp_path / "spill", compute)
    a = add(residency, "a", builder(tiny_model_dir, tmp_path / "a", compute, seed=0))
    a.forward_backward(data(), "cross_entropy").result()
    before = state(a)
    (tmp_path / "spill").write_text("a file where the spill directory goes: spills fail")
    with pytest.raises(OSError):
        residency.create("b", builder(tiny_model_dir, tmp_path / "b", compute, seed=0))
    assert residency.resident() == ["a"] and residency.spills == 0
    assert use(residency, "a") is a  # the same client, its gradients untouched
    assert_bit_equal(state(a), before)
