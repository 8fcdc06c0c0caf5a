"""Between the trainer and the workers: sharding, gathering, gradient reduction, placement.

The trainer hands over a mini-batch; dispatch shards it across data-parallel workers (mesh) or
sends one call to all (pass-through), and gathers the results in the caller's order. It also
owns placement (`engine.placement`): before each operation it parks on the CPU what the new
phase does not keep (sampling keeps only the weights; `offload()` parks everything) and reloads
what the operation needs, so no trainer ever moves tensors between devices. Phase changes are
recorded in `transitions` and every move in `moves`.

An executor runs calls on workers. `InProcessExecutor` holds workers in this process; a Ray
executor (one actor per worker, gradients all-reduced by torch.distributed) plugs in behind
the same protocol. Besides the primitives, Dispatch calls these `Worker` methods by name:
`check_datums` (every shard, before any rank computes), `forward_backward(..., commit=False)`
then `commit_gradients` or `discard_gradients` on every rank, and `offload` / `reload`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import torch

from posttrain.algo.losses import LossConfig
from posttrain.engine.batching import check_same_keys, shard_for_ranks
from posttrain.engine.placement import GROUPS, KEEPS, NEEDS, Operation, Placement, StateGroup
from posttrain.engine.worker import PassResult, Worker
from posttrain.types import AdamParams, Datum, SampleResponse, SamplingParams

Move = tuple[Literal["offload", "reload"], StateGroup]


class Executor(Protocol):
    """Runs a named worker method on every rank, with per-rank arguments."""

    @property
    def num_workers(self) -> int: ...

    def run(self, method: str, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        """Call `method` on each rank with its arguments; a rank given None is skipped."""
        ...

    def reduce_gradients(self) -> None:
        """Make every rank's gradient the sum over ranks (an all-reduce with SUM)."""
        ...


class InProcessExecutor:
    """Workers in this process, called one after another."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        if not workers:
            raise ValueError("InProcessExecutor needs at least one worker")
        self.workers = list(workers)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def run(self, method: str, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        return [
            None if args is None else getattr(worker, method)(*args)
            for worker, args in zip(self.workers, per_rank_args, strict=True)
        ]

    def reduce_gradients(self) -> None:
        if len(self.workers) == 1:
            return
        per_rank = [w.grads() for w in self.workers]
        summed: dict[str, torch.Tensor | None] = {}
        for name in per_rank[0]:
            grads = [g.cpu() for rank in per_rank if (g := rank[name]) is not None]
            summed[name] = torch.stack(grads).sum(0) if grads else None
        for worker in self.workers:
            worker.set_grads(summed)


def merge_results(results: Sequence[PassResult], shards: Sequence[Sequence[int]]) -> PassResult:
    """Gather per-rank results back into one, in the original datum order."""
    total = sum(len(s) for s in shards)
    logprobs: list[torch.Tensor] = [torch.empty(0)] * total
    diagnostics: dict[str, list[torch.Tensor]] = {}
    for result, shard in zip(results, shards, strict=True):
        for index, lp in zip(shard, result.logprobs, strict=True):
            logprobs[index] = lp
        for key, values in result.diagnostics.items():
            diagnostics.setdefault(key, []).append(values)
    return PassResult(
        logprobs=logprobs,
        loss_sum=sum(r.loss_sum for r in results),
        num_tokens=sum(r.num_tokens for r in results),
        diagnostics={k: torch.cat(v) for k, v in diagnostics.items()},
    )


class Dispatch:
    """Mesh and pass-through calls over an executor, and placement of the workers' state."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.placement: Placement = "train"
        self.resident: set[StateGroup] = set(GROUPS)
        self.transitions: list[tuple[Placement, Placement]] = []
        self.moves: list[Move] = []

    @property
    def num_workers(self) -> int:
        return self.executor.num_workers

    def prepare(self, operation: Operation, placement: Placement | None = None) -> None:
        """Enter `placement` (None: stay), parking what it does not keep (also what a
        placement-neutral call such as load_state brought back meanwhile), then reload what
        `operation` needs. Every worker makes the same moves, in the same order."""
        if placement is not None:
            if placement != self.placement:
                self.transitions.append((self.placement, placement))
                self.placement = placement
            for group in reversed(GROUPS):
                if group in self.resident and group not in KEEPS[placement]:
                    self._move("offload", group)
        for group in GROUPS:
            if group in NEEDS[operation] and group not in self.resident:
                self._move("reload", group)

    def offload(self) -> None:
        """Park weights, gradients and optimizer state on the CPU until the next call needs
        them (for a process that hands the device to another engine for a while)."""
        self.prepare("offload", "offloaded")

    def _move(self, action: Literal["offload", "reload"], group: StateGroup) -> None:
        self.executor.run(action, [(group,)] * self.num_workers)
        if action == "offload":
            self.resident.discard(group)
        else:
            self.resident.add(group)
        self.moves.append((action, group))

    def pass_through(self, method: str, *args: object) -> list[object]:
        return self.executor.run(method, [args] * self.num_workers)

    def mesh(
        self, method: str, datums: Sequence[Datum], loss_fn: str, config: LossConfig
    ) -> PassResult:
        """Shard datums by tokens across ranks, run `method` on each shard, gather in order.

        With several ranks the shards are all checked before any rank computes, and a
        forward_backward is committed on every rank only once all succeeded (else discarded on
        all), so a failed call leaves every rank's gradients as they were.
        """
        check_same_keys(datums)
        shards = shard_for_ranks([d.length for d in datums], self.num_workers)
        # A rank with an empty shard has nothing to compute; sum semantics make skipping exact.
        args: list[tuple[object, ...] | None] = [
            ([datums[i] for i in shard], loss_fn, config) if shard else None for shard in shards
        ]
        if self.num_workers == 1:
            results = self.executor.run(method, args)
        else:
            self.executor.run("check_datums", args)
            results = self._run_all_or_nothing(method, args)
        kept = [(r, s) for r, s in zip(results, shards, strict=True) if s]
        return merge_results([r for r, _ in kept], [s for _, s in kept])  # type: ignore[misc]

    def _run_all_or_nothing(
        self, method: str, args: Sequence[tuple[object, ...] | None]
    ) -> list[object]:
        if method != "forward_backward":
            return self.executor.run(method, args)
        ranks = [None if a is None else () for a in args]
        try:
            results = self.executor.run(method, [None if a is None else (*a, False) for a in args])
        except BaseException:
            self.executor.run("discard_gradients", ranks)
            raise
        self.executor.run("commit_gradients", ranks)
        return results

    def forward(self, datums: Sequence[Datum], loss_fn: str, config: LossConfig) -> PassResult:
        self.prepare("forward", "train")
        return self.mesh("forward", datums, loss_fn, config)

    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, config: LossConfig
    ) -> PassResult:
        self.prepare("forward_backward", "train")
        return self.mesh("forward_backward", datums, loss_fn, config)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        self.prepare("optim_step", "train")
        self.executor.reduce_gradients()
        metrics = self.pass_through("optim_step", adam)
        return metrics[0]  # type: ignore[return-value]

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        """Each rank samples its share of the prompts on its current weights."""
        self.prepare("sample", "sample")
        shards = shard_for_ranks([1] * len(prompts), self.num_workers)
        # Seeds are offset by the prompt's global index so sharding never changes the tokens.
        args = [
            ([prompts[i] for i in shard], num_samples, params, shard[0]) if shard else None
            for shard in shards
        ]
        out: list[SampleResponse] = []
        for result in self.executor.run("sample", args):
            if result is not None:
                out.extend(result)  # type: ignore[arg-type]
        return out

    def compute_logprobs(self, prompt: Sequence[int]) -> list[float | None]:
        self.prepare("sample", "sample")
        return self.executor.run("compute_logprobs", [(prompt,)] + [None] * (self.num_workers - 1))[
            0
        ]  # type: ignore[return-value]

    def reference_logprobs(self, datums: Sequence[Datum]) -> list[list[float]]:
        self.prepare("reference")
        shards = shard_for_ranks([d.length for d in datums], self.num_workers)
        args = [([datums[i] for i in shard],) if shard else None for shard in shards]
        out: list[list[float]] = [[] for _ in datums]
        for result, shard in zip(
            self.executor.run("reference_logprobs", args), shards, strict=True
        ):
            for index, lp in zip(shard, result or [], strict=True):  # type: ignore[arg-type]
                out[index] = lp.tolist()
        return out

    def save_state(
        self, path: Path, with_optimizer: bool, trainer_state: Mapping[str, object]
    ) -> Path:
        # Replicas hold identical weights and optimizer state: rank 0 writes for all.
        self.prepare("save")
        args: list[tuple[object, ...] | None] = [None] * self.num_workers
        args[0] = (path, with_optimizer, trainer_state)
        return self.executor.run("save_state", args)[0]  # type: ignore[return-value]

    def save_weights(self, path: Path) -> Path:
        self.prepare("save")
        args: list[tuple[object, ...] | None] = [None] * self.num_workers
        args[0] = (path,)
        return self.executor.run("save_weights", args)[0]  # type: ignore[return-value]

    def load_state(self, path: Path, *, with_optimizer: bool) -> Path:
        self.prepare("load")
        self.pass_through("load_state", path, with_optimizer)
        return path

    @property
    def tokenizer(self) -> object:
        return self.executor.run("get_tokenizer", [()] + [None] * (self.num_workers - 1))[0]
