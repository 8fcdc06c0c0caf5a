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
moments to rank 0, which writes them through a plain replica (built on first use) with the
ordinary checkpoint code; loading reads and checks on rank 0, then broadcasts.
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
from torch.distributed.tensor import DTensor, distribute_tensor

from posttrain.algo.losses import LossConfig
from posttrain.engine.batching import split_by_token_budget
from posttrain.engine.checkpoint import RNG_FILE, JSONValue
from posttrain.engine.dispatch import merge_results
from posttrain.engine.logprob_pass import causal_lm
from posttrain.engine.optim import create_adamw_optimizer, set_adam_params
from posttrain.engine.ray_actor import collective
from posttrain.engine.resume_state import (
    optimizer_state_by_index,
    optimizer_state_by_name,
    set_rng_state,
)
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

    `mirror_factory` builds a plain replica on rank 0 when a checkpoint is first written or
    read (held from then on: rank 0 needs the full model's memory once more for it).
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

    def call(self, method: str, args: Sequence[object] | None) -> object:
        """Run `method` on this rank; `args=None` takes part in the collectives only."""
        if method == "forward_backward":
            return self.forward_backward(args)
        if method in _READS_GATHERED:
            with self.gathered():
                return None if args is None else getattr(self.worker, method)(*args)
        if method in ("save_state", "save_weights"):
            return self.save(method, args)
        if method == "load_state":
            return self.load_state(args)
        if method == "optim_step":
            assert args is not None
            return self.optim_step(cast(AdamParams, args[0]))
        return None if args is None else getattr(self.worker, method)(*args)

    def forward_backward(self, args: Sequence[object] | None) -> PassResult | None:
        """The worker's forward_backward one micro-batch at a time, padded to the busiest rank."""
        datums: list[Datum] = [] if args is None else list(cast(Sequence[Datum], args[0]))
        budget = self.worker.config.micro_batch_tokens
        micro = split_by_token_budget([d.length for d in datums], budget) if datums else []
        count = torch.tensor([len(micro)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        results: list[PassResult] = []
        for index in range(int(count.item())):
            if index < len(micro):
                loss_fn, config = cast(str, args[1]), cast(LossConfig, args[2])  # type: ignore[index]
                part = [datums[i] for i in micro[index]]
                results.append(self.worker.forward_backward(part, loss_fn, config))
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
        """Trainable weights or gradients by name, whole (gathered) on every rank, on CPU."""
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
        """As `Worker.optim_step`, with the clipping norm taken over the whole sharded gradient."""
        grads = [p.grad for p in self.worker.trainable_parameters().values() if p.grad is not None]
        if not grads:  # the same on every rank: gradients are sharded or summed everywhere
            return {
                "grad_norm:mean": 0.0,
                "skipped:sum": 1.0,
                "learning_rate:mean": adam.learning_rate,
            }
        norm = self.grad_norm()
        skipped = not math.isfinite(norm)
        if not skipped:
            # torch's clip_grad_norm_ rule: scale by max_norm / (norm + 1e-6) when below 1.
            coef = adam.grad_clip_norm / (norm + 1e-6) if adam.grad_clip_norm > 0 else 1.0
            if coef < 1.0:
                for grad in grads:
                    grad.mul_(coef)
            set_adam_params(
                self.worker.optimizer,
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
            self.worker.optimizer.step()
        self.worker.zero_grad()
        return {
            "grad_norm:mean": norm if not skipped else float("nan"),
            "skipped:sum": float(skipped),
            "learning_rate:mean": adam.learning_rate,
        }

    def mirror(self) -> Worker:
        """Rank 0's plain replica for checkpoint I/O (its construction leaves the RNG alone)."""
        if self._mirror is None:
            with torch.random.fork_rng(devices=[]):
                self._mirror = self._mirror_factory()
        return self._mirror

    def save(self, method: str, args: Sequence[object] | None) -> Path | None:
        """Gather to rank 0 and write there with the plain checkpoint code."""
        with_optimizer = method == "save_state" and bool(args[1]) if args is not None else False
        flags = [with_optimizer]
        with collective("gathering the state to save"):
            dist.broadcast_object_list(flags, src=0)  # only rank 0 was given the arguments
            weights = self.full_tensors("weights")
            moments = self._full_optimizer_state() if flags[0] else None
        if args is None:
            return None
        mirror = self.mirror()
        with torch.no_grad():
            for name, param in mirror.trainable_parameters().items():
                param.copy_(cast(torch.Tensor, weights[name]))
        mirror.zero_grad()
        if moments is not None:
            path = cast(Path, args[0])
            by_index = optimizer_state_by_index(
                mirror.model, mirror.optimizer, moments, source=path
            )
            mirror.optimizer.load_state_dict(by_index)
        return cast(Path, getattr(mirror, method)(*args))

    def _full_optimizer_state(self) -> dict[str, object]:
        """AdamW state by parameter name with whole tensors (the checkpoint's format)."""
        optimizer = self.worker.optimizer
        names = {id(p): n for n, p in self.worker.model.named_parameters()}
        state: dict[str, dict[str, object]] = {}
        members: list[str] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                members.append(names[id(param)])
                if param in optimizer.state:  # the same on every rank: all ranks step together
                    state[names[id(param)]] = {
                        key: _full(v).cpu().clone() if isinstance(v, torch.Tensor) else v
                        for key, v in optimizer.state[param].items()
                    }
        # Every group carries the same settings (set_adam_params sets them all): one group.
        settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**settings, "params": members}]}

    def load_state(self, args: Sequence[object] | None) -> dict[str, JSONValue] | None:
        """Rank 0 reads and checks the checkpoint into its replica, then every rank takes it.

        A refused checkpoint raises on rank 0 and `PeerRefused` on the others, all before any
        rank's weights change.
        """
        trainer_state: dict[str, JSONValue] | None = None
        header: list[object] = [None, False, ""]  # rank 0's error, with_optimizer, path
        if args is not None:
            header[1:] = [bool(args[1]), str(args[0])]
            try:
                trainer_state = self.mirror().load_state(cast(Path, args[0]), bool(args[1]))
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
        with torch.no_grad():
            for name, param in self.worker.trainable_parameters().items():
                source = mirror.trainable_parameters()[name] if mirror is not None else None
                _local(param).copy_(_local(self._broadcast(source, param)))
        if header[1]:
            self._load_optimizer_state(mirror)
            if args is None:  # on rank 0, loading the replica restored this process's RNG
                set_rng_state(torch.load(Path(cast(str, header[2])) / RNG_FILE, weights_only=True))
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
    first, second = (sharded, replicated) if sharded else (replicated, [])
    optimizer = create_adamw_optimizer(first)
    if second:
        optimizer.add_param_group({"params": second})
    return optimizer
