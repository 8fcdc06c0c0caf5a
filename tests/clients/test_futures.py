"""Client futures: submission order, await and .result(), errors confined to their own call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from posttrain.clients.create import create_training_client
from posttrain.clients.futures import APIFuture, OrderedRunner
from posttrain.types import AdamParams, Datum, ModelInput


def datums(seed: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        ids = torch.randint(3, 250, (9,), generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(ids[:-1].tolist()),
                {"target_tokens": ids[1:], "weights": torch.full((8,), 0.1)},
            )
        )
    return out


def test_runner_keeps_submission_order_across_threads() -> None:
    """Calls submitted from several threads run one at a time, in the order submitted."""
    runner = OrderedRunner("test")
    ran: list[int] = []
    submitted: list[int] = []
    lock = threading.Lock()
    active = []

    def call(index: int) -> int:
        active.append(index)
        assert len(active) == 1  # never two at once
        time.sleep(0.001 * (index % 3))  # uneven durations must not reorder anything
        ran.append(index)
        active.pop()
        return index

    def submit_some(start: int) -> None:
        for index in range(start, start + 10):
            with lock:  # the order of submission is the order the lock was taken
                submitted.append(index)
                futures[index] = runner.submit(lambda index=index: call(index))

    futures: dict[int, APIFuture[int]] = {}
    threads = [threading.Thread(target=submit_some, args=(k * 10,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    runner.close()
    assert all(futures[i].result() == i for i in range(30))  # each call's own value
    assert ran == submitted
    assert sorted(ran) == list(range(30))


def test_interleaved_client_calls_run_in_submission_order(tiny_model_dir, tmp_path):
    """forward / forward_backward / optim_step / forward submitted without waiting give what
    the same calls give when each is waited for: each saw the state its predecessors left."""
    made = [
        create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / name)
        for name in ("queued", "waited")
    ]
    queued, waited = made
    step = AdamParams(learning_rate=1e-2)
    futures = [
        queued.forward(datums(0), "cross_entropy"),
        queued.forward_backward(datums(1), "cross_entropy"),
        queued.optim_step(step),
        queued.forward(datums(0), "cross_entropy"),
        queued.forward_backward(datums(2), "cross_entropy"),
        queued.optim_step(step),
        queued.forward(datums(0), "cross_entropy"),
    ]
    expected = [
        waited.forward(datums(0), "cross_entropy").result(),
        waited.forward_backward(datums(1), "cross_entropy").result(),
        waited.optim_step(step).result(),
        waited.forward(datums(0), "cross_entropy").result(),
        waited.forward_backward(datums(2), "cross_entropy").result(),
        waited.optim_step(step).result(),
        waited.forward(datums(0), "cross_entropy").result(),
    ]
    losses = [f.result().metrics for f in futures]
    assert losses == [e.metrics for e in expected]  # bit-identical: the same work, same order
    # The three forwards saw three different models, so order really mattered.
    assert len({losses[i]["loss:sum"] for i in (0, 3, 6)}) == 3
    for client in made:
        client.close()


async def test_await_and_result_both_work_and_errors_stay_with_their_call(tiny_model_dir, tmp_path):
    client = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path)
    good = datums(0)
    bad = [Datum(ModelInput.from_ints([5, 999]), {"target_tokens": [6, 7], "weights": [1.0, 1.0]})]
    first = client.forward(good, "cross_entropy")
    failing = client.forward_backward(bad, "cross_entropy")
    after = client.forward(good, "cross_entropy")
    awaited = await first
    assert awaited.metrics == first.result().metrics  # a future can be awaited and .result()-ed
    with pytest.raises(ValueError, match="999"):
        await failing
    with pytest.raises(ValueError, match="999"):
        failing.result()
    later = await after  # calls submitted after the failure still ran
    assert later.metrics == awaited.metrics  # and the failure changed nothing
    assert (await client.forward(good, "cross_entropy").result_async()).metrics == awaited.metrics
    mapped = client.forward(good, "cross_entropy").map(lambda out: out.metrics["loss:sum"])
    assert mapped.result() == awaited.metrics["loss:sum"]
    client.close()
