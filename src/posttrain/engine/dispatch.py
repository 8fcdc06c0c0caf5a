"""Between the trainer and the workers: sharding, gathering, gradient reduction, placement.

The trainer hands over a mini-batch; dispatch shards it across data-parallel workers (mesh) or
sends one call to all (pass-through), and gathers the results in the caller's order. It also
owns placement (`engine.placement`): before each operation it parks on the CPU what the new
phase does not keep (sampling keeps only the weights; `offload()` parks everything) and reloads
what the operation needs, so no trainer ever moves tensors between devices. Phase changes are
recorded in `transitions` and every move in `moves`.

An executor runs calls on workers. `InProcessExecutor` holds workers in this process; a Ray
executor (one actor per worker, gradients all-reduced by torch.distributed) plugs in behind
the same protocol. A forward_backward is all or nothing on every executor: every shard is
checked (`Worker.check_datums`) before any worker computes, so refused input changes nothing
anywhere, whatever the number of workers; how a fault during the pass is undone is the
executor's own business (`Executor.forward_backward`). A forward changes nothing, so each worker
checks its own shard as it runs. Placement moves go to the executor as one batch per `prepare`
(`Executor.move`: `Worker.offload` / `Worker.reload`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, cast

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

    def forward_backward(self, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        """`Worker.forward_backward` all or nothing: every rank's arguments (datums, loss_fn,
        config) pass `Worker.check_datums` before any rank computes, else the first refusal is
        raised and nothing changed; a fault after that leaves no rank's gradients changed (or
        the executor can no longer be used)."""
        ...

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """On every worker, park `offload` on the CPU, then bring `reload` back, in order."""
        ...

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Make every rank's gradient the sum over ranks (an all-reduce with SUM), then step
        every rank; returns rank 0's metrics (every rank's are equal)."""
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

    def forward_backward(self, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        """Every shard checked first; then each worker runs uncommitted and all commit once all
        succeeded, else all discard (a failing worker discards its own), so a fault on one
        worker leaves every worker's gradients as they were."""
        for worker, args in zip(self.workers, per_rank_args, strict=True):
            if args is not None:
                worker.check_datums(*cast(tuple[Sequence[Datum], str, LossConfig], args))
        results: list[object] = []
        ran: list[Worker] = []
        try:
            for worker, args in zip(self.workers, per_rank_args, strict=True):
                if args is None:
                    results.append(None)
                    continue
                shard = cast(tuple[Sequence[Datum], str, LossConfig], args)
                results.append(worker.forward_backward(*shard, commit=False, checked=True))
                ran.append(worker)
        except BaseException:
            for worker in ran:
                worker.discard_gradients()
            raise
        for worker in ran:
            worker.commit_gradients()
        return results

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        for worker in self.workers:
            for group in offload:
                worker.offload(group)
            for group in reload:
                worker.reload(group)

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
        self.resident: set[StateGroup] = set(GROUPS)  # on the device on every worker
        self.unsettled: set[StateGroup] = set()  # a failed move may have left them anywhere
        self.transitions: list[tuple[Placement, Placement]] = []
        self.moves: list[Move] = []

    @property
    def num_workers(self) -> int:
        return self.executor.num_workers

    def prepare(self, operation: Operation, placement: Placement | None = None) -> None:
        """Enter `placement` (None: stay), parking what it does not keep (also what a
        placement-neutral call such as load_state brought back meanwhile), then reload what
        `operation` needs: one executor call for all the moves. Every worker makes the same
        moves, in the same order."""
        offload: list[StateGroup] = []
        if placement is not None:
            if placement != self.placement:
                self.transitions.append((self.placement, placement))
                self.placement = placement
            offload = [
                g
                for g in reversed(GROUPS)
                if (g in self.resident or g in self.unsettled) and g not in KEEPS[placement]
            ]
        reload: list[StateGroup] = [
            g for g in GROUPS if g in NEEDS[operation] and g not in self.resident
        ]
        if offload or reload:
            self._move(offload, reload)

    def offload(self) -> None:
        """Park weights, gradients and optimizer state on the CPU until the next call needs
        them (for a process that hands the device to another engine for a while)."""
        self.prepare("offload", "offloaded")

    def _move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Until the moves succeed on every worker, the groups they touch are unsettled (some
        workers may have moved them and others not): neither resident, so an operation that
        needs one reloads it, nor forgotten, so a placement that parks it parks it again. Both
        are safe to repeat (a worker's offload and reload of a group already there do nothing)."""
        touched: set[StateGroup] = {*offload, *reload}
        self.resident -= touched
        self.unsettled |= touched
        self.executor.move(offload, reload)
        self.unsettled -= touched
        self.resident |= set(reload)
        self.moves.extend([*(("offload", g) for g in offload), *(("reload", g) for g in reload)])

    def pass_through(self, method: str, *args: object) -> list[object]:
        return self.executor.run(method, [args] * self.num_workers)

    def mesh(
        self, method: str, datums: Sequence[Datum], loss_fn: str, config: LossConfig
    ) -> PassResult:
        """Shard datums by tokens across ranks, run `method` on each shard, gather in order.

        A forward_backward is all or nothing (`Executor.forward_backward`): every shard is
        checked before any rank computes, and a failure leaves every rank's gradients as they
        were.
        """
        check_same_keys(datums)
        shards = shard_for_ranks([d.length for d in datums], self.num_workers)
        # A rank with an empty shard has nothing to compute; sum semantics make skipping exact.
        args: list[tuple[object, ...] | None] = [
            ([datums[i] for i in shard], loss_fn, config) if shard else None for shard in shards
        ]
        if method == "forward_backward":
            results = self.executor.forward_backward(args)
        else:
            results = self.executor.run(method, args)
        kept = [(r, s) for r, s in zip(results, shards, strict=True) if s]
        return merge_results([r for r, _ in kept], [s for _, s in kept])  # type: ignore[misc]

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
        return self.executor.optim_step(adam)

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
