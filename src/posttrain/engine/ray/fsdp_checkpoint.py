"""FSDP2 checkpoints in the single-process format (see `engine.fsdp`).

Saving: the ranks gather whole trainable weights and AdamW moments to rank 0 alone, which writes
them through a plain replica on its CPU (built on first use; it keeps the weights, never the
moments) with the ordinary checkpoint code. Loading: rank 0 reads and checks the checkpoint
into that replica, then broadcasts weights, moments and RNG state, each rank keeping its piece.
Only rank 0 reads or writes files, so a checkpoint need not be on a filesystem the other nodes
see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from posttrain.data.checks import expect
from posttrain.engine.checkpoint import JSONValue
from posttrain.engine.executor import LoadRequest, SaveRequest
from posttrain.engine.ray.rank_calls import PeerRefused, collective
from posttrain.engine.resume_state import (
    optimizer_state_by_index,
    optimizer_state_by_name,
    rng_state,
    set_rng_state,
)
from posttrain.engine.worker import Worker


class ShardedCheckpoints:
    """Checkpoint I/O of one rank's sharded `worker`.

    `mirror_factory` builds rank 0's plain replica when a checkpoint is first written or read,
    ideally on the CPU (one built elsewhere is moved there): held from then on, it costs rank 0
    the full weights' memory once more on the CPU, and none on the device.
    """

    def __init__(self, worker: Worker, mirror_factory: Callable[[], Worker]) -> None:
        self.worker = worker
        self.rank = dist.get_rank()
        self.device = torch.device(worker.config.device)
        self._mirror_factory = mirror_factory
        self._mirror: Worker | None = None

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

    def save_state(self, request: SaveRequest | None) -> Path | None:
        """Gather to rank 0's replica and write the state there (only rank 0 is given the
        request; see `_save`)."""
        if request is None:
            return self._save(None, moments_for=None)
        return self._save(
            lambda mirror: mirror.save_state(
                request.path, request.with_optimizer, request.trainer_state
            ),
            moments_for=request.path if request.with_optimizer else None,
        )

    def save_weights(self, path: Path | None) -> Path | None:
        write = None if path is None else (lambda mirror: mirror.save_weights(path))
        return self._save(write, moments_for=None)

    def _save(
        self, write: Callable[[Worker], Path] | None, *, moments_for: Path | None
    ) -> Path | None:
        """Gather to rank 0's replica and `write` there with the plain checkpoint code; with the
        AdamW moments too when `moments_for` names the checkpoint. Only rank 0 is given
        `write`; if it cannot build its replica, every rank returns before gathering and rank 0
        raises that error."""
        header: list[object] = [False, False]  # with the moments, rank 0 has no replica
        mirror: Worker | None = None
        failure: Exception | None = None
        if write is not None:
            header[0] = moments_for is not None
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
        if mirror is None or write is None:
            return None
        mirror.zero_grad()
        try:
            if moments is not None and moments_for is not None:
                by_index = optimizer_state_by_index(
                    mirror.model, mirror.optimizer, moments, source=moments_for
                )
                mirror.optimizer.load_state_dict(by_index)
            return write(mirror)
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

    def load_state(self, request: LoadRequest | None) -> dict[str, JSONValue] | None:
        """Rank 0 reads and checks the checkpoint into its replica, then every rank takes it
        (weights, AdamW moments, and the RNG state rank 0's load restored): only rank 0 reads
        files, so the checkpoint need not be on a filesystem the other nodes see.

        A refused checkpoint raises on rank 0 and `PeerRefused` on the others, all before any
        rank's weights change.
        """
        trainer_state: dict[str, JSONValue] | None = None
        header: list[object] = [None, False, None]  # rank 0's error, with_optimizer, RNG state
        if request is not None:
            header[1] = request.with_optimizer
            try:
                trainer_state = self.mirror().load_state(
                    request.path, with_optimizer=request.with_optimizer
                )
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
                set_rng_state(expect(header[2], dict, "rank 0's RNG state"))
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
        states: dict[str, dict[str, object]] = {}
        if saved is not None:
            states = expect(saved["state"], dict, "the optimizer state")
            groups = expect(saved["param_groups"], list, "the optimizer's param_groups")
            settings = {k: v for k, v in groups[0].items() if k != "params"}
            shapes = {
                name: {k: _describe(v) for k, v in state.items()} for name, state in states.items()
            }
            layout[0] = (settings, shapes)
        dist.broadcast_object_list(layout, src=0)
        settings, shapes = expect(layout[0], tuple, "rank 0's optimizer layout")
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
                shape, dtype = described
                value = expect(states[name][key], torch.Tensor, name) if saved else None
                like = param if shape == _full_shape(param) else torch.empty(shape, dtype=dtype)
                state[key] = self._broadcast(value, like.detach()).to(dtype)
            optimizer.state[param] = state
        for group in optimizer.param_groups:
            group.update(settings)


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
