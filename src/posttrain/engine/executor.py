"""The executor protocol: how `Dispatch` runs the worker primitives on its data-parallel ranks.

One typed method per primitive. A worker primitive takes one input per rank, None for a rank
with nothing to do, and returns one result per rank (None where it had nothing to do); Dispatch
builds the inputs with SkyRL's two dispatch kinds: `mesh` (a mini-batch cut into per-rank
shards, gathered back in order) and `pass_through` (the same input for every rank), or gives
rank 0 alone a call whose answer every replica shares (saving, `compute_logprobs`). Placement
moves and the optimizer step always run on every rank.

`InProcessExecutor` holds its workers in this process; `engine.ray_executor.RayExecutor` runs
one per Ray actor. Each owns its all-or-nothing forward_backward: every shard is checked once
(`Worker.check_datums`, then the pass runs with `checked=True`) before any rank computes, and a
fault during the pass leaves no rank's gradients changed, or the executor unusable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import torch

from posttrain.algo.losses import LossConfig
from posttrain.engine.checkpoint import JSONValue
from posttrain.engine.placement import StateGroup
from posttrain.engine.worker import PassResult, Worker
from posttrain.tokenizer import Tokenizer
from posttrain.types import AdamParams, Datum, SampleResponse, SamplingParams

A = TypeVar("A")
R = TypeVar("R")
TensorKind = Literal["weights", "grads"]


@dataclass(frozen=True)
class PassShard:
    """One rank's share of a forward or forward_backward."""

    datums: Sequence[Datum]
    loss_fn: str
    config: LossConfig


@dataclass(frozen=True)
class PromptShard:
    """One rank's share of a sample call; `first_index` is its first prompt's index in the
    whole call (seeds are offset by it, so sharding never changes the tokens)."""

    prompts: Sequence[Sequence[int]]
    num_samples: int
    params: SamplingParams
    first_index: int


@dataclass(frozen=True)
class SaveRequest:
    path: Path
    with_optimizer: bool
    trainer_state: Mapping[str, JSONValue]


@dataclass(frozen=True)
class LoadRequest:
    path: Path
    with_optimizer: bool


class Executor(Protocol):
    """Runs the worker primitives on every rank (see the module docstring)."""

    @property
    def num_workers(self) -> int: ...

    def forward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]: ...

    def forward_backward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        """All or nothing: every shard passes `Worker.check_datums` before any rank computes,
        else the first refusal is raised and nothing changed; a fault after that leaves no
        rank's gradients changed (or the executor can no longer be used)."""
        ...

    def sample(self, shards: Sequence[PromptShard | None]) -> list[list[SampleResponse] | None]: ...

    def compute_logprobs(
        self, prompts: Sequence[Sequence[int] | None]
    ) -> list[list[float | None] | None]: ...

    def reference_logprobs(
        self, shards: Sequence[Sequence[Datum] | None]
    ) -> list[list[torch.Tensor] | None]: ...

    def save_state(self, requests: Sequence[SaveRequest | None]) -> list[Path | None]: ...

    def save_weights(self, paths: Sequence[Path | None]) -> list[Path | None]: ...

    def load_state(self, requests: Sequence[LoadRequest | None]) -> None: ...

    def set_logprob_chunk_size(self, sizes: Sequence[int | None]) -> None: ...

    def set_packing(self, values: Sequence[bool | None]) -> None: ...

    def get_tokenizer(self) -> Tokenizer | None:
        """Rank 0's tokenizer (every rank holds the same)."""
        ...

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """On every rank, park `offload` on the CPU, then bring `reload` back, in order."""
        ...

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Make every rank's gradient the sum over ranks (an all-reduce with SUM), then step
        every rank; returns rank 0's metrics (every rank's are equal)."""
        ...

    def full_tensors(self, kind: TensorKind) -> list[dict[str, torch.Tensor | None]]:
        """Each rank's whole trainable weights or gradients by name, on the CPU (inspection)."""
        ...

    def weight_digests(self) -> list[str]:
        """A digest of each rank's whole trainable weights: all equal while replicas agree."""
        ...


def worker_tensors(worker: Worker, kind: TensorKind) -> dict[str, torch.Tensor | None]:
    """A plain worker's trainable weights or gradients by name, copied to the CPU."""
    params = worker.trainable_parameters()
    if kind == "weights":
        return {n: p.detach().cpu().clone() for n, p in params.items()}
    return {n: None if p.grad is None else p.grad.cpu().clone() for n, p in params.items()}


def weight_digest(weights: Mapping[str, torch.Tensor | None]) -> str:
    """SHA-256 of whole trainable weights' bytes in name order (equal for equal weights,
    sharded or not)."""
    digest = hashlib.sha256()
    for name, tensor in weights.items():
        assert tensor is not None
        digest.update(name.encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class InProcessExecutor:
    """Workers in this process, called one after another."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        if not workers:
            raise ValueError("InProcessExecutor needs at least one worker")
        self.workers = list(workers)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def _each(self, inputs: Sequence[A | None], run: Callable[[Worker, A], R]) -> list[R | None]:
        if len(inputs) != len(self.workers):
            raise ValueError(
                f"{len(inputs)} inputs for {len(self.workers)} workers; give one per worker"
            )
        return [None if x is None else run(w, x) for w, x in zip(self.workers, inputs, strict=True)]

    def forward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        # forward changes nothing: each worker checks its own shard as it runs.
        return self._each(shards, lambda w, s: w.forward(s.datums, s.loss_fn, s.config))

    def forward_backward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        """Every shard checked first; then each worker runs uncommitted and all commit once all
        succeeded, else all discard (a failing worker discards its own), so a fault on one
        worker leaves every worker's gradients as they were."""
        self._each(shards, lambda w, s: w.check_datums(s.datums, s.loss_fn, s.config))
        results: list[PassResult | None] = []
        ran: list[Worker] = []
        try:
            for worker, s in zip(self.workers, shards, strict=True):
                if s is None:
                    results.append(None)
                    continue
                results.append(
                    worker.forward_backward(
                        s.datums, s.loss_fn, s.config, commit=False, checked=True
                    )
                )
                ran.append(worker)
        except BaseException:
            for worker in ran:
                worker.discard_gradients()
            raise
        for worker in ran:
            worker.commit_gradients()
        return results

    def sample(self, shards: Sequence[PromptShard | None]) -> list[list[SampleResponse] | None]:
        return self._each(
            shards, lambda w, s: w.sample(s.prompts, s.num_samples, s.params, s.first_index)
        )

    def compute_logprobs(
        self, prompts: Sequence[Sequence[int] | None]
    ) -> list[list[float | None] | None]:
        return self._each(prompts, lambda w, prompt: w.compute_logprobs(prompt))

    def reference_logprobs(
        self, shards: Sequence[Sequence[Datum] | None]
    ) -> list[list[torch.Tensor] | None]:
        return self._each(shards, lambda w, datums: w.reference_logprobs(datums))

    def save_state(self, requests: Sequence[SaveRequest | None]) -> list[Path | None]:
        return self._each(
            requests, lambda w, r: w.save_state(r.path, r.with_optimizer, r.trainer_state)
        )

    def save_weights(self, paths: Sequence[Path | None]) -> list[Path | None]:
        return self._each(paths, lambda w, path: w.save_weights(path))

    def load_state(self, requests: Sequence[LoadRequest | None]) -> None:
        self._each(requests, lambda w, r: w.load_state(r.path, with_optimizer=r.with_optimizer))

    def set_logprob_chunk_size(self, sizes: Sequence[int | None]) -> None:
        self._each(sizes, lambda w, size: w.set_logprob_chunk_size(size))

    def set_packing(self, values: Sequence[bool | None]) -> None:
        self._each(values, lambda w, packing: w.set_packing(packing))

    def get_tokenizer(self) -> Tokenizer | None:
        return self.workers[0].get_tokenizer()

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        for worker in self.workers:
            worker.move(offload, reload)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        self.reduce_gradients()
        metrics = [worker.optim_step(adam) for worker in self.workers]
        return metrics[0]

    def reduce_gradients(self) -> None:
        """Every worker's gradients become their sum over the workers."""
        if len(self.workers) == 1:
            return
        per_rank = [w.grads() for w in self.workers]
        summed: dict[str, torch.Tensor | None] = {}
        for name in per_rank[0]:
            grads = [g.cpu() for rank in per_rank if (g := rank[name]) is not None]
            summed[name] = torch.stack(grads).sum(0) if grads else None
        for worker in self.workers:
            worker.set_grads(summed)

    def full_tensors(self, kind: TensorKind) -> list[dict[str, torch.Tensor | None]]:
        return [worker_tensors(worker, kind) for worker in self.workers]

    def weight_digests(self) -> list[str]:
        return [weight_digest(tensors) for tensors in self.full_tensors("weights")]
