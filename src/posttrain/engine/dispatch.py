"""Between the trainer and the workers: sharding, gathering, gradient reduction, placement.

The trainer hands over a mini-batch; dispatch shards it across data-parallel workers (`mesh`) or
gives every worker the same input (`pass_through`), SkyRL's two dispatch kinds, and gathers the
results in the caller's order. An `engine.executor.Executor` runs the calls: one typed method per
primitive, each executor owning its all-or-nothing forward_backward.

Dispatch also owns placement (`engine.placement`): before each operation it parks on the CPU
what the new phase does not keep (sampling keeps only the weights; `offload()` parks everything)
and reloads what the operation needs, so no trainer ever moves tensors between devices. Phase
changes are recorded in `transitions` and every move in `moves`; the moves of one `prepare` go
to the executor as one batch (`Executor.move`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeVar, cast

import torch

from posttrain.algo.losses import LossConfig
from posttrain.engine.batching import check_same_keys, shard_for_ranks
from posttrain.engine.checkpoint import JSONValue
from posttrain.engine.executor import Executor, LoadRequest, PassShard, PromptShard, SaveRequest
from posttrain.engine.placement import GROUPS, KEEPS, NEEDS, Operation, Placement, StateGroup
from posttrain.engine.worker import PassResult
from posttrain.tokenizer import Tokenizer
from posttrain.types import AdamParams, Datum, SampleResponse, SamplingParams

A = TypeVar("A")
R = TypeVar("R")
Move = tuple[Literal["offload", "reload"], StateGroup]


def merge_results(results: Sequence[PassResult], shards: Sequence[Sequence[int]]) -> PassResult:
    """Gather per-rank results back into one, in the original datum order."""
    total = sum(len(s) for s in shards)
    logprobs: list[torch.Tensor] = [torch.empty(0)] * total
    entropies: list[torch.Tensor] | None = [torch.empty(0)] * total
    diagnostics: dict[str, list[torch.Tensor]] = {}
    for result, shard in zip(results, shards, strict=True):
        for index, lp in zip(shard, result.logprobs, strict=True):
            logprobs[index] = lp
        if result.entropies is None:
            entropies = None
        elif entropies is not None:
            for index, entropy in zip(shard, result.entropies, strict=True):
                entropies[index] = entropy
        for key, values in result.diagnostics.items():
            diagnostics.setdefault(key, []).append(values)
    return PassResult(
        logprobs=logprobs,
        loss_sum=sum(r.loss_sum for r in results),
        num_tokens=sum(r.num_tokens for r in results),
        diagnostics={k: torch.cat(v) for k, v in diagnostics.items()},
        entropies=entropies,
    )


class Dispatch:
    """Mesh and pass-through calls over an executor, and placement of the workers' state."""

    def __init__(self, executor: Executor, *, park_for_sampling: bool = True) -> None:
        """`park_for_sampling=False` keeps gradients and AdamW moments on the device while
        sampling (`placement.parks_for_sampling` decides for a GPU with room to spare)."""
        self.executor = executor
        self.park_for_sampling = park_for_sampling
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
            keeps = KEEPS[placement]
            if placement == "sample" and not self.park_for_sampling:
                keeps = KEEPS["train"]
            offload = [
                g
                for g in reversed(GROUPS)
                if (g in self.resident or g in self.unsettled) and g not in keeps
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

    def mesh(
        self,
        run: Callable[[list[A | None]], list[R | None]],
        sizes: Sequence[int],
        shard: Callable[[list[int]], A],
    ) -> list[tuple[list[int], R]]:
        """SkyRL's mesh dispatch: cut a mini-batch into contiguous per-rank shards of near-equal
        total `sizes` (tokens, or 1 per prompt), make each rank's input from its indices
        (`shard`), `run` them, and return each result with its indices, in rank order. A rank
        with an empty share is given None and skipped: sum semantics make that exact."""
        shards = shard_for_ranks(sizes, self.num_workers)
        results = run([shard(indices) if indices else None for indices in shards])
        gathered: list[tuple[list[int], R]] = []
        for rank, (indices, result) in enumerate(zip(shards, results, strict=True)):
            if indices:
                if result is None:
                    raise RuntimeError(f"rank {rank} was given {len(indices)} items, returned none")
                gathered.append((indices, result))
        return gathered

    def pass_through(self, run: Callable[[list[A]], R], value: A) -> R:
        """SkyRL's pass-through dispatch: the same input for every rank."""
        return run([value] * self.num_workers)

    def on_rank0(self, run: Callable[[list[A | None]], list[R | None]], value: A) -> R:
        """One rank's call whose answer every replica shares (the others are given None)."""
        result = run([value] + [None] * (self.num_workers - 1))[0]
        if result is None:
            raise RuntimeError("rank 0 returned no result")
        return result

    def _loss_pass(
        self,
        run: Callable[[list[PassShard | None]], list[PassResult | None]],
        datums: Sequence[Datum],
        loss_fn: str,
        config: LossConfig,
    ) -> PassResult:
        # Whole-call key check: each rank checks its own shard, not that shards agree.
        check_same_keys(datums)
        gathered = self.mesh(
            run,
            [d.length for d in datums],
            lambda rows: PassShard([datums[i] for i in rows], loss_fn, config),
        )
        return merge_results([r for _, r in gathered], [rows for rows, _ in gathered])

    def forward(self, datums: Sequence[Datum], loss_fn: str, config: LossConfig) -> PassResult:
        self.prepare("forward", "train")
        return self._loss_pass(self.executor.forward, datums, loss_fn, config)

    def forward_backward(
        self, datums: Sequence[Datum], loss_fn: str, config: LossConfig
    ) -> PassResult:
        """All or nothing (`Executor.forward_backward`): every shard is checked before any rank
        computes, and a failure leaves every rank's gradients as they were."""
        self.prepare("forward_backward", "train")
        return self._loss_pass(self.executor.forward_backward, datums, loss_fn, config)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        self.prepare("optim_step", "train")
        return self.executor.optim_step(adam)

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[SampleResponse]:
        """Each rank samples its share of the prompts on its current weights."""
        self.prepare("sample", "sample")
        gathered = self.mesh(
            self.executor.sample,
            [1] * len(prompts),
            lambda rows: PromptShard([prompts[i] for i in rows], num_samples, params, rows[0]),
        )
        return [response for _, responses in gathered for response in responses]

    def compute_logprobs(self, prompt: Sequence[int]) -> list[float | None]:
        self.prepare("sample", "sample")
        return self.on_rank0(self.executor.compute_logprobs, prompt)

    def reference_logprobs(self, datums: Sequence[Datum]) -> list[list[float]]:
        self.prepare("reference")
        gathered = self.mesh(
            self.executor.reference_logprobs,
            [d.length for d in datums],
            lambda rows: [datums[i] for i in rows],
        )
        out: list[list[float]] = [[] for _ in datums]
        for rows, logprobs in gathered:
            for index, lp in zip(rows, logprobs, strict=True):
                out[index] = lp.tolist()
        return out

    def save_state(
        self, path: Path, with_optimizer: bool, trainer_state: Mapping[str, object]
    ) -> Path:
        # Replicas hold identical weights and optimizer state: rank 0 writes for all. The
        # trainer state is checked to be JSON when it is written.
        self.prepare("save")
        state = cast(Mapping[str, JSONValue], trainer_state)
        return self.on_rank0(self.executor.save_state, SaveRequest(path, with_optimizer, state))

    def save_weights(self, path: Path) -> Path:
        self.prepare("save")
        return self.on_rank0(self.executor.save_weights, path)

    def load_state(self, path: Path, *, with_optimizer: bool) -> Path:
        self.prepare("load")
        self.pass_through(self.executor.load_state, LoadRequest(path, with_optimizer))
        return path

    def set_logprob_chunk_size(self, chunk_size: int) -> None:
        """Tokens per chunk of every worker's logprob computation, from the next call on."""
        self.pass_through(self.executor.set_logprob_chunk_size, chunk_size)

    def set_packing(self, packing: bool) -> None:
        """Whether every worker packs its datums (`engine.packing`), from the next call on."""
        self.pass_through(self.executor.set_packing, packing)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.executor.get_tokenizer()
