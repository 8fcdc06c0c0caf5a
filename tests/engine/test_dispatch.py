"""Dispatch's placement over two in-process workers: one executor call per `prepare`, and
bookkeeping that stays right when a move fails on one worker after succeeding on another.

(Sharding, gathering and all-or-nothing calls are tested through the clients:
tests/clients/test_local_client.py and test_local_invariance.py, and the Ray ones.)
"""

from __future__ import annotations

import pytest
import torch

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.types import AdamParams, Datum, ModelInput, SamplingParams

PROMPT = ModelInput.from_ints([5, 6])
PARAMS = SamplingParams(max_tokens=2, seed=0)


def datums(seed: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in (4, 7, 5):
        ids = torch.randint(3, 250, (length + 1,), generator=gen)
        inputs = {"target_tokens": ids[1:], "weights": torch.full((length,), 0.1)}
        out.append(Datum(ModelInput.from_ints(ids[:-1].tolist()), inputs))
    return out


def two_workers(tiny_model_dir, path) -> LocalTrainingClient:
    return create_training_client(tiny_model_dir, num_workers=2, storage_dir=path)


def test_each_prepare_moves_in_one_executor_call(tiny_model_dir, tmp_path, monkeypatch):
    client = two_workers(tiny_model_dir, tmp_path)
    executor = client.dispatch.executor
    batches: list[tuple[list[str], list[str]]] = []
    real = executor.move

    def recorded(offload, reload):  # type: ignore[no-untyped-def]
        batches.append((list(offload), list(reload)))
        real(offload, reload)

    monkeypatch.setattr(executor, "move", recorded)
    client.forward_backward(datums(0), "cross_entropy").result()  # nothing to move
    client.sample(PROMPT, 1, PARAMS).result()
    client.forward_backward(datums(1), "cross_entropy").result()
    client.optim_step(AdamParams()).result()
    client.sample(PROMPT, 1, PARAMS).result()  # the weights stay: nothing to reload
    park = (["optimizer", "grads"], [])
    assert batches == [park, ([], ["grads"]), ([], ["optimizer"]), park]
    # Dispatch still records every move, one by one.
    assert client.dispatch.moves == [
        ("offload", "optimizer"),
        ("offload", "grads"),
        ("reload", "grads"),
        ("reload", "optimizer"),
        ("offload", "optimizer"),
        ("offload", "grads"),
    ]
    client.close()


def test_a_move_that_fails_on_one_worker_is_redone(tiny_model_dir, tmp_path, monkeypatch):
    """Worker 0 parks its gradients, worker 1 fails to: Dispatch must not believe them resident
    (worker 0 would refuse the next forward_backward forever) nor forget them (offload() must
    park worker 1's). The run then ends where one without the fault does."""
    faulty, clean = (two_workers(tiny_model_dir, tmp_path / name) for name in ("faulty", "clean"))
    second = faulty.dispatch.executor.workers[1]  # type: ignore[attr-defined]
    real = second.offload

    def fails_on_grads(group):  # type: ignore[no-untyped-def]
        if group == "grads":
            raise RuntimeError("simulated device failure")
        real(group)

    for client in (faulty, clean):
        client.forward_backward(datums(0), "cross_entropy").result()
    monkeypatch.setattr(second, "offload", fails_on_grads)
    with pytest.raises(RuntimeError, match="simulated"):
        faulty.sample(PROMPT, 1, PARAMS).result()
    monkeypatch.setattr(second, "offload", real)
    assert "grads" not in faulty.dispatch.resident
    faulty.offload().result()  # parks worker 1's gradients; worker 0's stay parked as they were
    for worker in faulty.dispatch.executor.workers:  # type: ignore[attr-defined]
        assert worker.offloaded == {"weights", "grads", "optimizer"}
    for client in (faulty, clean):
        client.forward_backward(datums(1), "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    pairs = zip(faulty.dispatch.executor.workers, clean.dispatch.executor.workers, strict=True)  # type: ignore[attr-defined]
    for a, b in pairs:
        wa, wb = a.trainable_parameters(), b.trainable_parameters()
        assert all(torch.equal(wa[n], wb[n]) for n in wb)
    for client in (faulty, clean):
        client.close()
