"""FSDP2 sharding of a worker's model across its process group (torch `fully_shard`).

Layout. Each decoder layer, and the decoder around them (embeddings, final norm), is one
`fully_shard` unit: a rank holds 1/world of those weights, of their gradients and of their
AdamW moments, and all-gathers one unit at a time in forward and backward. The unembedding
stays replicated: the logprob pass reads its weight directly (in chunks) instead of calling the
module, so FSDP has no hook to gather it. Its gradient is summed with the DDP all-reduce.

Sum semantics. FSDP averages gradients by default; a divide factor of 1 with force-sum
reduction makes its reduce-scatter a plain SUM (gloo has no PREMUL_SUM), so the update equals
the single-process update on the whole batch.

Collectives line up. A forward all-gathers and a backward reduce-scatters, so every rank runs
as many forward_backward micro-batches as the busiest one: a rank with fewer (or no) datums
runs zero-loss passes on one token, which add exact zeros to the gradient sums. What only reads
the weights (forward, logprobs, sampling, where each rank decodes a different number of steps)
runs on gathered weights, with no collective inside.

Checkpoints keep the single-process format: the ranks gather full trainable weights and AdamW
moments to rank 0 alone, which writes them through a plain replica on its CPU (built on first
use; it keeps the weights, never the moments) with the ordinary checkpoint code; loading reads
and checks on rank 0, then broadcasts weights, moments and RNG state.

Known limit: every rank loads a whole replica before `fully_shard` cuts it (`WorkerHost`
builds the plain worker first), so each device must hold the full model once at start-up.
Building the model on the meta device and loading only each rank's shard would lift it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from posttrain.algo.losses import LossConfig
from posttrain.engine.checkpoint import JSONValue
from posttrain.engine.dispatch import merge_results
from posttrain.engine.logprob_pass import causal_lm
from posttrain.engine.optim import create_adamw_optimizer, set_adam_params
from posttrain.engine.ray_actor import collective
from posttrain.engine.resume_state import (
    optimizer_state_by_index,
    optimizer_state_by_name,
    rng_state,
    set_rng_state,
)
from posttrain.engine.shared_prefix import plan_micro_batches
from posttrain.engine.worker import PassResult, Worker
from posttrain.types import AdamParams, Datum

# Worker methods every rank must enter under FSDP, with or without work of its own.
GATHERING_METHODS = frozenset(
    {
        "forward",
        "forward_backward",
        "reference_logprobs",
        "sample",
        "compute_logprobs",
        "save_state",
        "save_weights",
        "load_state",
    }
)
_READS_GATHERED = ("forward", "reference_logprobs", "sample", "compute_logprobs")


class ShardedWorker:
    """A `Worker` whose decoder is sharded over the default process group with FSDP2.

    `mirror_factory` builds rank 0's plain replica when a checkpoint is first written or read,
    ideally on the CPU (one built elsewhere is moved there): held from then on, it costs rank 0
    the full weights' memory once more on the CPU, and none on the device.
    """

    def __init__(self, worker: Worker, mirror_factory: Callable[[], Worker]) -> None:
        # A shared-prefix micro-batch runs the decoder twice, a padding pass once: the ranks'
        # all-gathers would no longer line up, so sharded workers run every row whole.
        worker.config = replace(worker.config, min_shared_prefix=0)
        self.worker = worker
        self.rank = dist.get_rank()
        self.device = torch.device(worker.config.device)
        decoder = causal_lm(worker.model).get_decoder()  # type: ignore[operator]
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(
                f"FSDP2 sharding needs a decoder with a .layers list; {type(decoder).__name__} "
                "has none: use sharding='replicate'"
            )
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        self.units: list[FSDPModule] = []
        for module in [*layers, decoder]:
            unit = cast(FSDPModule, fully_shard(module, mesh=mesh, reshard_after_forward=True))
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            self.units.append(unit)
        self.decoder = cast(nn.Module, self.units[-1])
        worker.optimizer = _grouped_adamw(list(worker.trainable_parameters().values()))
        self._mirror_factory = mirror_factory
        self._mirror: Worker | None = None

    def call(self, method: str, args: Sequence[object] | None, *, checked: bool = False) -> object:
        """Run `method` on this rank; `args=None` takes part in the collectives only.
        `checked`: the datums passed `Worker.check_datums` already."""
        if method == "forward_backward":
            return self.forward_backward(args, checked=checked)
        if method in _READS_GATHERED:
            with self.gathered():
                if args is None:
                    return None
                run = getattr(self.worker, method)
                return run(*args, checked=True) if checked else run(*args)
        if method in ("save_state", "save_weights"):
            return self.save(method, args)
        if method == "load_state":
            return self.load_state(args)
        if method == "optim_step":
            assert args is not None
            return self.optim_step(cast(AdamParams, args[0]))
        return None if args is None else getattr(self.worker, method)(*args)

    def forward_backward(
        self, args: Sequence[object] | None, *, checked: bool = False
    ) -> PassResult | None:
        """The worker's forward_backward one micro-batch at a time (planned longest first, as
        the worker plans them), padded to the busiest rank."""
        datums: list[Datum] = [] if args is None else list(cast(Sequence[Datum], args[0]))
        rows = [d.model_input.to_ints() for d in datums]
        # min_length 0: no shared prefixes under FSDP (see __init__).
        micro = [m.rows for m in plan_micro_batches(rows, self.worker.config.micro_batch_tokens, 0)]
        count = torch.tensor([len(micro)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        results: list[PassResult] = []
        for index in range(int(count.item())):
            if index < len(micro):
                loss_fn, config = cast(str, args[1]), cast(LossConfig, args[2])  # type: ignore[index]
                part = [datums[i] for i in micro[index]]
                results.append(self.worker.forward_backward(part, loss_fn, config, checked=checked))
            else:
                self._zero_pass()
        return None if args is None else merge_results(results, micro)

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

    def full_tensors(self, kind: Literal["weights", "grads"]) -> dict[str, torch.Tensor | None]:
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

    def mirror(self) -> Worker:
        """Rank 0's plain replica on the CPU for checkpoint I/O (its construction leaves the RNG
        alone)."""
        if self._mirror is None:
            with torch.random.fork_rng(devices=[]):
                built = self._mirror_factory()
            if built.config.device != "cpu":
                built = Worker(built.model, replace(built.config, device="cpu"))
            self._mirror = built
        return self._mirror

    def save(self, method: str, args: Sequence[object] | None) -> Path | None:
        """Gather to rank 0's replica and write there with the plain checkpoint code. Only rank
        0 is given `args`; if it cannot build its replica, every rank returns before gathering
        and rank 0 raises that error."""
        header: list[object] = [False, False]  # with_optimizer, rank 0 has no replica
        mirror: Worker | None = None
        failure: Exception | None = None
        if args is not None:
            header[0] = method == "save_state" and bool(args[1])
            try:
                mirror = self.mirror()
            except Exception as exc:
                failure, header[1] = exc, True
        with collective("sharing the save's header"):
            dist.broadcast_object_list(header, src=0)
        if failure is not None:
            raise failure
        if header[1]:
            return None
        with collective("gathering the state to save"):
            self._gather_weights(mirror)
            moments = self._full_optimizer_state() if header[0] else None
        if mirror is None or args is None:
            return None
        mirror.zero_grad()
        try:
            if moments is not None:
                by_index = optimizer_state_by_index(
                    mirror.model, mirror.optimizer, moments, source=cast(Path, args[0])
                )
                mirror.optimizer.load_state_dict(by_index)
            return cast(Path, getattr(mirror, method)(*args))
        finally:
            mirror.optimizer.state.clear()  # whole moments on rank 0 for good would undo sharding

    def _gather_weights(self, mirror: Worker | None) -> None:
        """Every trainable weight, whole, into rank 0's replica (`mirror`, None elsewhere)."""
        targets = mirror.trainable_parameters() if mirror is not None else {}
        with torch.no_grad():
            for name, param in self.worker.trainable_parameters().items():
                whole = gather_to_rank0(param.detach())
                if whole is not None:
                    targets[name].copy_(whole)

    def _full_optimizer_state(self) -> dict[str, object] | None:
        """AdamW state by parameter name with whole tensors (the checkpoint's format), on rank 0
        (None on the others, which send their pieces)."""
        optimizer = self.worker.optimizer
        names = {id(p): n for n, p in self.worker.model.named_parameters()}
        state: dict[str, dict[str, object]] = {}
        members: list[str] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                members.append(names[id(param)])
                if param in optimizer.state:  # the same on every rank: all ranks step together
                    state[names[id(param)]] = {
                        key: gather_to_rank0(v) if isinstance(v, torch.Tensor) else v
                        for key, v in optimizer.state[param].items()
                    }
        if self.rank != 0:
            return None
        # Every group carries the same settings (set_adam_params sets them all): one group.
        settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**settings, "params": members}]}

    def load_state(self, args: Sequence[object] | None) -> dict[str, JSONValue] | None:
        """Rank 0 reads and checks the checkpoint into its replica, then every rank takes it
        (weights, AdamW moments, and the RNG state rank 0's load restored): only rank 0 reads
        files, so the checkpoint need not be on a filesystem the other nodes see.

        A refused checkpoint raises on rank 0 and `PeerRefused` on the others, all before any
        rank's weights change.
        """
        trainer_state: dict[str, JSONValue] | None = None
        header: list[object] = [None, False, None]  # rank 0's error, with_optimizer, RNG state
        if args is not None:
            header[1] = bool(args[1])
            try:
                trainer_state = self.mirror().load_state(cast(Path, args[0]), bool(args[1]))
                # Loading with the optimizer restored the checkpoint's RNG in this process.
                header[2] = rng_state() if header[1] else None
            except Exception as exc:
                header[0] = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                with collective("sharing the checkpoint's header"):
                    dist.broadcast_object_list(header, src=0)
        else:
            with collective("sharing the checkpoint's header"):
                dist.broadcast_object_list(header, src=0)
            if header[0] is not None:
                raise PeerRefused(f"rank 0 refused the checkpoint: {header[0]}")
        self.worker.zero_grad()
        mirror = self.mirror() if self.rank == 0 else None
        sources = mirror.trainable_parameters() if mirror is not None else {}
        with torch.no_grad():
            for name, param in self.worker.trainable_parameters().items():
                _local(param).copy_(_local(self._broadcast(sources.get(name), param)))
        if header[1]:
            self._load_optimizer_state(mirror)
            if mirror is None:
                set_rng_state(cast(dict[str, object], header[2]))
        if mirror is not None:
            mirror.optimizer.state.clear()  # the ranks hold their shards of it now
        return trainer_state

    def _broadcast(self, source: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """Rank 0's whole `source` on every rank, cut to this rank's piece when `like` is."""
        if source is not None:
            full = source.detach().to(self.device, copy=True)
        else:
            full = torch.empty(_full_shape(like), dtype=like.dtype, device=self.device)
        dist.broadcast(full, src=0)
        if isinstance(like, DTensor):
            return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
        return full

    def _load_optimizer_state(self, mirror: Worker | None) -> None:
        """Every rank's AdamW state from rank 0's replica; moments cut like their parameter."""
        saved = optimizer_state_by_name(mirror.model, mirror.optimizer) if mirror else None
        layout: list[object] = [None]
        if saved is not None:
            states = cast(dict[str, dict[str, object]], saved["state"])
            groups = cast(list[dict[str, object]], saved["param_groups"])
            settings = {k: v for k, v in groups[0].items() if k != "params"}
            shapes = {
                name: {k: _describe(v) for k, v in state.items()} for name, state in states.items()
            }
            layout[0] = (settings, shapes)
        dist.broadcast_object_list(layout, src=0)
        settings, shapes = cast(tuple[dict[str, object], dict[str, dict[str, object]]], layout[0])
        optimizer = self.worker.optimizer
        params = self.worker.trainable_parameters()
        optimizer.state.clear()
        for name, entries in shapes.items():
            param = params[name]
            state: dict[str, object] = {}
            for key, described in entries.items():
                if not isinstance(described, tuple):
                    state[key] = described  # a plain value, sent with the layout
                    continue
                shape, dtype = cast(tuple[tuple[int, ...], torch.dtype], described)
                value = cast(torch.Tensor, saved["state"][name][key]) if saved else None  # type: ignore[index]
                like = param if shape == _full_shape(param) else torch.empty(shape, dtype=dtype)
                state[key] = self._broadcast(value, like.detach()).to(dtype)
            optimizer.state[param] = state
        for group in optimizer.param_groups:
            group.update(settings)


class PeerRefused(RuntimeError):
    """Raised on the other ranks when rank 0 refuses a checkpoint (nothing was changed)."""


def gather_to_rank0(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor on rank 0's CPU, None on the other ranks: each rank sends its piece of a
    DTensor to rank 0 alone (a gather, not an all-gather)."""
    rank = dist.get_rank()
    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu().clone() if rank == 0 else None
    if tuple(tensor.placements) != (Shard(0),):  # not FSDP2's layout: gather everywhere
        whole = tensor.full_tensor()
        return whole.cpu() if rank == 0 else None
    # FSDP2 cuts dim 0 like torch.chunk: every piece but the last ones has ceil(n / world) rows
    # (a last one may be shorter or empty), so the pieces padded to that size, concatenated in
    # rank order and trimmed to n rows are the whole tensor.
    world = dist.get_world_size()
    rows = -(-tensor.shape[0] // world)
    with torch.no_grad():
        local = tensor.to_local()
        piece = local.new_zeros((rows, *local.shape[1:]))
        piece[: local.shape[0]] = local
    pieces = [torch.empty_like(piece) for _ in range(world)] if rank == 0 else None
    dist.gather(piece, pieces, dst=0)
    if pieces is None:
        return None
    return torch.cat(pieces)[: tensor.shape[0]].cpu()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank if it is a DTensor (a collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a view of its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)  # a DTensor reports its global shape


def _describe(value: object) -> object:
    """What the other ranks need to receive `value`: (shape, dtype) of a tensor, else itself."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return value


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
