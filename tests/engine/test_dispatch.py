"""Dispatch over the typed executor protocol: what it gives each rank and how it gathers
(against an executor written here, which is all a Dispatch needs), the datum checks of a call
(each datum exactly once, whatever the number of workers), and placement over two in-process
workers: one executor call per `prepare`, and bookkeeping that stays right when a move fails on
one worker after succeeding on another.

(Results against one process, and all-or-nothing calls, are tested through the clients:
tests/clients/test_local_client.py and test_local_invariance.py, and the Ray ones.)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from check_counting import count_checks, rows

from posttrain.algo.losses import LossConfig
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.executor import (
    Executor,
    LoadRequest,
    PassShard,
    PromptShard,
    SaveRequest,
    TensorKind,
)
from posttrain.engine.placement import StateGroup
from posttrain.engine.worker import PassResult
from posttrain.models.tiny import build_tokenizer
from posttrain.tokenizer import Tokenizer
from posttrain.types import (
    AdamParams,
    Datum,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
)

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
    return create_training_client(tiny_model_dir, num_workers=2, storage_dir=path, lora_rank=None)


def test_each_prepare_moves_in_one_executor_call(tiny_model_dir, tmp_path, monkeypatch):
    client = two_workers(tiny_model_dir, tmp_path)
    executor = client.dispatch.executor
    batches: list[tuple[list[str], list[str]]] = []
    real = executor.move

    def recorded(offload, reload):
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
    second = faulty.dispatch.executor.workers[1]  # pyright: ignore[reportAttributeAccessIssue]
    real = second.parking.offload

    def fails_on_grads(group):
        if group == "grads":
            raise RuntimeError("simulated device failure")
        real(group)

    for client in (faulty, clean):
        client.forward_backward(datums(0), "cross_entropy").result()
    monkeypatch.setattr(second.parking, "offload", fails_on_grads)
    with pytest.raises(RuntimeError, match="simulated"):
        faulty.sample(PROMPT, 1, PARAMS).result()
    monkeypatch.setattr(second.parking, "offload", real)
    assert "grads" not in faulty.dispatch.resident
    faulty.offload().result()  # parks worker 1's gradients; worker 0's stay parked as they were
    for worker in faulty.dispatch.executor.workers:  # pyright: ignore[reportAttributeAccessIssue]
        assert worker.parking.offloaded == {"weights", "grads", "optimizer"}
    for client in (faulty, clean):
        client.forward_backward(datums(1), "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    pairs = zip(faulty.dispatch.executor.workers, clean.dispatch.executor.workers, strict=True)  # pyright: ignore[reportAttributeAccessIssue]
    for a, b in pairs:
        wa, wb = a.trainable_parameters(), b.trainable_parameters()
        assert all(torch.equal(wa[n], wb[n]) for n in wb)
    for client in (faulty, clean):
        client.close()


def sized(lengths: Sequence[int]) -> list[Datum]:
    """Datum i starts with token 100 + i, so any result can say which datum it came from."""
    out = []
    for i, length in enumerate(lengths):
        ids = [100 + i] + [3] * (length - 1)
        inputs = {"target_tokens": [4] * length, "weights": [1.0] * length}
        out.append(Datum(ModelInput.from_ints(ids), inputs))
    return out


class RecordingExecutor:
    """The executor protocol over `num_workers` pretend ranks: records each call's per-rank
    inputs and answers with values that name their input."""

    def __init__(self, num_workers: int) -> None:
        self._num_workers = num_workers
        self.calls: list[tuple[str, list[object]]] = []
        self.passes: list[list[PassShard | None]] = []  # forward and forward_backward inputs
        self.prompts: list[list[PromptShard | None]] = []  # sample inputs
        self.tokenizer = build_tokenizer()

    @property
    def num_workers(self) -> int:
        return self._num_workers

    def _record(self, name: str, inputs: Sequence[object]) -> None:
        assert len(inputs) == self._num_workers
        self.calls.append((name, list(inputs)))

    def _pass(self, name: str, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        self._record(name, shards)
        self.passes.append(list(shards))
        return [
            None
            if s is None
            else PassResult(
                logprobs=[
                    torch.full((d.length,), float(d.model_input.to_ints()[0])) for d in s.datums
                ],
                loss_sum=float(len(s.datums)),
                num_tokens=sum(d.length for d in s.datums),
                diagnostics={"rank": torch.full((1,), float(rank))},
            )
            for rank, s in enumerate(shards)
        ]

    def forward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        return self._pass("forward", shards)

    def forward_backward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        return self._pass("forward_backward", shards)

    def sample(self, shards: Sequence[PromptShard | None]) -> list[list[SampleResponse] | None]:
        self._record("sample", shards)
        self.prompts.append(list(shards))
        return [
            None
            if s is None
            else [
                SampleResponse([SampledSequence("stop", [p[0], s.first_index + i], [0.0, 0.0])])
                for i, p in enumerate(s.prompts)
            ]
            for s in shards
        ]

    def compute_logprobs(
        self, prompts: Sequence[Sequence[int] | None]
    ) -> list[list[float | None] | None]:
        self._record("compute_logprobs", prompts)
        return [None if p is None else [None, *map(float, p[1:])] for p in prompts]

    def reference_logprobs(
        self, shards: Sequence[Sequence[Datum] | None]
    ) -> list[list[torch.Tensor] | None]:
        self._record("reference_logprobs", shards)
        return [
            None
            if s is None
            else [torch.full((d.length,), -float(d.model_input.to_ints()[0])) for d in s]
            for s in shards
        ]

    def save_state(self, requests: Sequence[SaveRequest | None]) -> list[Path | None]:
        self._record("save_state", requests)
        return [None if r is None else r.path / "state" for r in requests]

    def save_weights(self, paths: Sequence[Path | None]) -> list[Path | None]:
        self._record("save_weights", paths)
        return [None if p is None else p / "weights" for p in paths]

    def load_state(self, requests: Sequence[LoadRequest | None]) -> None:
        self._record("load_state", requests)

    def set_logprob_chunk_size(self, sizes: Sequence[int | None]) -> None:
        self._record("set_logprob_chunk_size", sizes)

    def set_packing(self, values: Sequence[bool | None]) -> None:
        self._record("set_packing", values)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        self.calls.append(("move", [list(offload), list(reload)]))

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        self.calls.append(("optim_step", [adam]))
        return {"learning_rate:mean": adam.learning_rate}

    def full_tensors(self, kind: TensorKind) -> list[dict[str, torch.Tensor | None]]:
        return [{} for _ in range(self._num_workers)]

    def weight_digests(self) -> list[str]:
        return ["" for _ in range(self._num_workers)]


def test_an_executor_is_all_a_dispatch_needs(tmp_path):
    recording = RecordingExecutor(3)
    executor: Executor = recording  # pyright checks the protocol here
    dispatch = Dispatch(executor)
    config = LossConfig()
    # 60 tokens over 3 ranks, contiguous, by where each datum's middle token falls:
    # middles 5, 15, 25, 35, 50 of 60 -> ranks 0, 0, 1, 1, 2.
    datums = sized([10, 10, 10, 10, 20])
    result = dispatch.forward_backward(datums, "cross_entropy", config)
    assert recording.calls[-1][0] == "forward_backward"
    shards = [s for s in recording.passes[-1] if s is not None]
    given = [[d.model_input.to_ints()[0] - 100 for d in s.datums] for s in shards]
    assert given == [[0, 1], [2, 3], [4]]
    assert all(s.loss_fn == "cross_entropy" and s.config is config for s in shards)
    # Gathered in the caller's order; sums and per-token values over every rank.
    assert [int(lp[0]) - 100 for lp in result.logprobs] == [0, 1, 2, 3, 4]
    assert (result.loss_sum, result.num_tokens) == (5.0, 60)
    assert result.diagnostics["rank"].tolist() == [0.0, 1.0, 2.0]
    # Fewer datums than ranks: a rank with no share is given None (sum semantics: exact).
    # One 4-token datum: its middle token (2 of 4) falls to rank 1.
    dispatch.forward(sized([4]), "cross_entropy", config)
    assert [s is None for s in recording.passes[-1]] == [True, False, True]

    prompts = [[7], [8], [9], [10]]
    responses = dispatch.sample(prompts, 1, SamplingParams(max_tokens=1))
    given = [(list(map(list, s.prompts)), s.first_index) for s in recording.prompts[-1] if s]
    assert given == [
        ([[7]], 0),
        ([[8], [9]], 1),
        ([[10]], 3),
    ]
    # Each response from the rank that sampled its prompt, seeded by its global index.
    assert [r.sequences[0].tokens for r in responses] == [[7, 0], [8, 1], [9, 2], [10, 3]]

    reference = dispatch.reference_logprobs(datums)
    assert [int(lp[0]) for lp in reference] == [-100, -101, -102, -103, -104]

    # Rank 0 answers for all where replicas agree; pass-through gives every rank the same.
    assert dispatch.compute_logprobs([5, 6]) == [None, 6.0]
    assert recording.calls[-1] == ("compute_logprobs", [[5, 6], None, None])
    assert dispatch.save_state(tmp_path, True, {"step": 3}) == tmp_path / "state"
    assert recording.calls[-1] == (
        "save_state",
        [SaveRequest(tmp_path, True, {"step": 3}), None, None],
    )
    assert dispatch.save_weights(tmp_path) == tmp_path / "weights"
    assert recording.calls[-1] == ("save_weights", [tmp_path, None, None])
    dispatch.load_state(tmp_path, with_optimizer=False)
    assert recording.calls[-1] == ("load_state", [LoadRequest(tmp_path, False)] * 3)
    dispatch.set_logprob_chunk_size(64)
    assert recording.calls[-1] == ("set_logprob_chunk_size", [64, 64, 64])
    dispatch.set_packing(True)
    assert recording.calls[-1] == ("set_packing", [True, True, True])
    assert dispatch.tokenizer is recording.tokenizer
    # Placement goes to the executor as one move per prepare: sampling parked the gradients
    # and AdamW moments, load_state brought the moments back to load into, and optim_step
    # brings back the gradients.
    moves = [args for name, args in recording.calls if name == "move"]
    assert moves == [[["optimizer", "grads"], []], [[], ["optimizer"]]]
    assert dispatch.optim_step(AdamParams(learning_rate=0.5)) == {"learning_rate:mean": 0.5}
    assert recording.calls[-2:] == [
        ("move", [[], ["grads"]]),
        ("optim_step", [AdamParams(learning_rate=0.5)]),
    ]


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_each_datum_is_checked_once_whatever_the_number_of_workers(
    tiny_model_dir, tmp_path, monkeypatch, num_workers
):
    client = create_training_client(
        tiny_model_dir, num_workers=num_workers, storage_dir=tmp_path, lora_rank=None
    )
    data = [*datums(0), *datums(1)]  # 6 datums: every worker has some
    counts = count_checks(monkeypatch)
    client.forward_backward(data, "cross_entropy").result()
    # Checked whole before any worker computes (all or nothing), and not again by the pass.
    assert counts.call == rows(data)
    assert counts.values == rows(data)
    counts.clear()
    client.forward(data, "cross_entropy").result()
    # forward changes nothing: the compute-free checks, once; the loss's own as it runs.
    assert counts.call == rows(data)
    assert not counts.values
    client.close()
