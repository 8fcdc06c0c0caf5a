"""FSDP2 sharding of a worker's model across its process group (torch `fully_shard`).

Layout. Each decoder layer, and the decoder around them (embeddings, final norm), is one
`fully_shard` unit: a rank holds 1/world of those weights, of their gradients and of their
AdamW moments, and all-gathers one unit at a time in forward and backward. The unembedding
stays replicated: the logprob pass reads its weight directly (in chunks) instead of calling the
module, so FSDP has no hook to gather it. Its gradient is summed with the DDP all-reduce. An
input embedding tied to it stays replicated with it (`tied_embedding_parameters`).

Sum semantics. FSDP averages gradients by default; a divide factor of 1 with force-sum
reduction makes its reduce-scatter a plain SUM (gloo has no PREMUL_SUM), so the update equals
the single-process update on the whole batch.

Collectives line up. A forward all-gathers and a backward reduce-scatters, so every rank runs
as many forward_backward micro-batches as the busiest one: a rank with fewer (or no) datums
runs zero-loss passes on one token, which add exact zeros to the gradient sums. What only reads
the weights (forward, logprobs, sampling, where each rank decodes a different number of steps)
runs on gathered weights, with no collective inside.

Checkpoints keep the single-process format (`engine.fsdp_checkpoint`): rank 0 writes and reads
them through a plain replica; the other ranks send it their pieces, or take theirs from it.

Known limit: every rank loads a whole replica before `fully_shard` cuts it (`WorkerHost`
builds the plain worker first), so each device must hold the full model once at start-up.
Building the model on the meta device and loading only each rank's shard would lift it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from posttrain.engine.dispatch import merge_results
from posttrain.engine.executor import PassShard, TensorKind
from posttrain.engine.optim import create_adamw_optimizer, set_adam_params
from posttrain.engine.ray.fsdp_checkpoint import ShardedCheckpoints
from posttrain.engine.ray.rank_calls import collective
from posttrain.engine.shared_prefix import plan_micro_batches
from posttrain.engine.worker import PassResult, Worker
from posttrain.models.load import causal_lm, lm_part, ties_embeddings
from posttrain.types import AdamParams


class ShardedWorker:
    """A `Worker` whose decoder is sharded over the default process group with FSDP2.

    `mirror_factory` builds rank 0's plain replica for checkpoint I/O (`checkpoints`).
    """

    def __init__(self, worker: Worker, mirror_factory: Callable[[], Worker]) -> None:
        # A shared-prefix micro-batch runs the decoder twice, a padding pass once: the ranks'
        # all-gathers would no longer line up, so sharded workers run every row whole.
        worker.config = replace(worker.config, min_shared_prefix=0)
        self.worker = worker
        self.rank = dist.get_rank()
        self.device = torch.device(worker.config.device)
        decoder = lm_part(causal_lm(worker.model), "get_decoder")
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(
                f"FSDP2 sharding needs a decoder with a .layers list; {type(decoder).__name__} "
                "has none: use sharding='replicate'"
            )
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        self.units: list[FSDPModule] = []
        kept = tied_embedding_parameters(worker.model)
        for module in [*layers, decoder]:
            unit = fully_shard(module, mesh=mesh, reshard_after_forward=True, ignored_params=kept)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            self.units.append(unit)
        self.decoder = cast(nn.Module, self.units[-1])
        worker.optimizer = _grouped_adamw(list(worker.trainable_parameters().values()))
        self.checkpoints = ShardedCheckpoints(worker, mirror_factory)

    def forward_backward(self, shard: PassShard | None) -> PassResult | None:
        """The worker's forward_backward one micro-batch at a time (planned longest first, as
        the worker plans them), padded to the busiest rank; `shard` None: padding only.

        The shard must have passed `Worker.check_datums` on every rank already (`WorkerHost`
        agrees on it first): a check failing here on one rank alone would leave the others
        waiting in a collective.
        """
        datums = [] if shard is None else list(shard.datums)
        rows = [d.model_input.to_ints() for d in datums]
        # min_length 0: no shared prefixes under FSDP (see __init__). Planned unpacked even when
        # the worker packs: a part within the budget padded (rows x longest) packs into one
        # micro-batch of at most as many rows of that width, so each part is still one pass.
        micro = [m.rows for m in plan_micro_batches(rows, self.worker.config.micro_batch_tokens, 0)]
        count = torch.tensor([len(micro)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        results: list[PassResult] = []
        for index in range(int(count.item())):
            if shard is not None and index < len(micro):
                part = [datums[i] for i in micro[index]]
                results.append(
                    self.worker.forward_backward(part, shard.loss_fn, shard.config, checked=True)
                )
            else:
                self._zero_pass()
        return None if shard is None else merge_results(results, micro)

    def _zero_pass(self) -> None:
        """A real micro-batch's collectives (gather, reduce-scatter) adding exact zeros."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        hidden = self.decoder(input_ids=ids).last_hidden_state
        (hidden.sum() * 0.0).backward()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit's full weights on every rank; forward passes inside gather nothing."""
        with collective("gathering the weights"):
            for unit in self.units:
                unit.unshard()
        self.units[-1].set_reshard_after_forward(False)  # recurses into every unit
        try:
            yield
        finally:
            self.units[-1].set_reshard_after_forward(True)
            for unit in self.units:
                unit.reshard()

    def full_tensors(self, kind: TensorKind) -> dict[str, torch.Tensor | None]:
        """Trainable weights or gradients by name, whole (gathered) on every rank, on CPU: for
        inspection (digests, tests). Checkpoints gather to rank 0 alone (`gather_to_rank0`)."""
        out: dict[str, torch.Tensor | None] = {}
        for name, param in self.worker.trainable_parameters().items():
            value = param.detach() if kind == "weights" else param.grad
            out[name] = None if value is None else _full(value).cpu().clone()
        return out

    def grad_norm(self) -> float:
        """L2 norm of the whole gradient: shard norms summed over ranks, replicas counted once."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for param in self.worker.trainable_parameters().values():
            grad = param.grad
            if isinstance(grad, DTensor):
                sharded += grad.to_local().double().square().sum()
            elif grad is not None:
                replicated += grad.double().square().sum()
        dist.all_reduce(sharded)
        return math.sqrt(float(sharded + replicated))

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """`Worker.optim_step`, with the clipping norm taken over the whole sharded gradient."""
        params = self.worker.trainable_parameters().values()
        # The same on every rank (gradients are sharded or summed everywhere): either all take
        # the worker's own no-gradient skip, or all enter grad_norm's all_reduce.
        if all(p.grad is None for p in params):
            return self.worker.optim_step(adam)
        return clip_and_step(self.worker, adam, self.grad_norm())


def tied_embedding_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The input embedding's parameters (its LoRA factors included) when the unembedding is
    tied to it: they stay replicated with it. Sharded, `fully_shard` would give the embedding
    new parameters and leave the unembedding, which the logprob pass reads directly, on the
    old ones: the tie silently undone (full fine-tuning trained two matrices, and saving
    missed `lm_head.weight`), a tied LoRA's factors read as shards."""
    lm = causal_lm(model)
    if not ties_embeddings(lm):
        return set()
    return set(lm_part(lm, "get_input_embeddings").parameters())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank if it is a DTensor (a collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _grouped_adamw(params: Sequence[nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with sharded and replicated parameters in separate groups: the foreach kernels
    take DTensors or plain tensors, never a mix."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    replicated = [p for p in params if not isinstance(p, DTensor)]
    first, *rest = [group for group in (sharded, replicated) if group]
    optimizer = create_adamw_optimizer(first)
    for group in rest:
        optimizer.add_param_group({"params": group})
    return optimizer


def clip_and_step(worker: Worker, adam: AdamParams, norm: float) -> dict[str, float]:
    """`Worker.optim_step` given the total pre-clip norm of the gradients it holds: clip by
    torch's clip_grad_norm_ rule (scale by max_norm / (norm + 1e-6) when below 1), step AdamW
    with this call's settings, zero the gradients; a non-finite norm skips the step."""
    skipped = not math.isfinite(norm)
    if not skipped:
        coef = adam.grad_clip_norm / (norm + 1e-6) if adam.grad_clip_norm > 0 else 1.0
        if coef < 1.0:
            for param in worker.trainable_parameters().values():
                if param.grad is not None:
                    param.grad.mul_(coef)
        set_adam_params(
            worker.optimizer,
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
        worker.optimizer.step()
    worker.zero_grad()
    return {
        "grad_norm:mean": norm if not skipped else float("nan"),
        "skipped:sum": float(skipped),
        "learning_rate:mean": adam.learning_rate,
    }
