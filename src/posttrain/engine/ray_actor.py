"""WorkerHost: what runs inside each Ray actor, one `Worker` and its place in the group.

Plain Python (no Ray import): `RayExecutor` wraps it with `ray.remote`, and it can be unit
tested in one process with a world of size 1.

Failures are reported so the executor can tell them apart: a collective that failed or timed
out raises `CollectiveError` (the group's collectives are out of step: it cannot continue); an
input every rank refused before changing anything comes back as a `Rejected` value (the group
stays usable); anything else is the worker's own exception.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.engine.placement import StateGroup
from posttrain.engine.ray_session import loopback_interface
from posttrain.engine.worker import Worker
from posttrain.types import AdamParams

if TYPE_CHECKING:
    from posttrain.engine.fsdp import ShardedWorker

Sharding = Literal["replicate", "fsdp2"]
BUCKET_NUMEL = 1 << 24  # 64 MiB of fp32 per all_reduce: few calls, bounded extra memory
# Methods whose items (datums or prompts) each rank counts, to show how work was shared.
_COUNTED = ("forward", "forward_backward", "sample", "reference_logprobs")


class CollectiveError(RuntimeError):
    """A collective failed or timed out on this rank: a peer stalled or died."""


@dataclass(frozen=True)
class Rejected:
    """This rank refused the call before changing anything; `error` is None when a peer did."""

    error: BaseException | None


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn any failure inside into a `CollectiveError` naming `what`."""
    try:
        yield
    except Exception as exc:
        raise CollectiveError(
            f"{what} failed ({type(exc).__name__}: {exc}); a collective that times out means "
            "a peer rank stalled or died"
        ) from exc


class WorkerHost:
    """One rank: builds its worker, joins the process group, sums gradients with its peers."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        factory: Callable[[], Worker],
        num_threads: int,
        loopback: bool,
        sharding: Sharding = "replicate",
        cpu_factory: Callable[[], Worker] | None = None,
    ) -> None:
        # Actors share the machine's cores; more threads than CPUs granted only thrash.
        torch.set_num_threads(num_threads)
        interface = loopback_interface() if loopback else None
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # keep gloo on loopback
        self.rank = rank
        self.world_size = world_size
        self.loopback = interface is not None
        self.host = "127.0.0.1" if interface is not None else _node_address()
        self.sharding = sharding
        self.served: Counter[str] = Counter()  # datums or prompts handled, per method
        self._factory = factory
        self._cpu_factory = cpu_factory  # FSDP2: rank 0's checkpoint replica, built on the CPU
        self._worker: Worker | None = None
        self._sharded: ShardedWorker | None = None
        self._store: dist.Store | None = None

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise RuntimeError("WorkerHost.build() has not run")
        return self._worker

    def build(self) -> None:
        """Load the model (a separate call so a loading error keeps its exception type)."""
        self._worker = self._factory()

    def create_store(self) -> str:
        """Rank 0: where the ranks meet. A file when all ranks share this machine's loopback
        (no socket at all), else a TCP store on a free port of this node."""
        if self.loopback:
            return "file://" + str(Path(tempfile.mkdtemp(prefix="posttrain-group-")) / "store")
        self._store = dist.TCPStore(
            self.host, 0, self.world_size, is_master=True, wait_for_workers=False
        )
        return f"tcp://{self.host}:{self._store.port}"

    def join_group(self, rendezvous: str, backend: str, timeout_s: float) -> None:
        """Join the process group, take rank 0's trainable weights (replicas start equal),
        then shard the model if asked (the whole model was loaded first: see engine.fsdp's
        known limit)."""
        timeout = timedelta(seconds=timeout_s)
        store = self._store
        if rendezvous.startswith("file://"):
            store = dist.FileStore(rendezvous.removeprefix("file://"), self.world_size)
        elif store is None:
            host, port = rendezvous.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(
                host, int(port), self.world_size, is_master=False, timeout=timeout
            )
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        with torch.no_grad():
            for param in self.worker.trainable_parameters().values():
                dist.broadcast(param.data, src=0)
        if self.sharding == "fsdp2":
            from posttrain.engine.fsdp import ShardedWorker

            self._sharded = ShardedWorker(self.worker, self._cpu_factory or self._factory)

    def call(self, method: str, args: Sequence[object] | None, check: bool = False) -> object:
        """Run `method` (args None: this rank only takes part in the collectives).

        With `check` (Dispatch's forward_backward: `args` are datums, loss_fn, config), every
        rank first checks its own shard and the ranks agree with one all_reduce, so either all
        compute or none does; the worker is then told its datums were checked.
        """
        if args is not None and method in _COUNTED:
            self.served[method] += len(args[0])  # type: ignore[arg-type]
        if check:
            refused = self._agree(args)
            if refused is not None:
                return refused
        if method == "load_state":  # refused before any weight changes: the group carries on
            try:
                return self._run(method, args, checked=False)
            except CollectiveError:
                raise
            except Exception as exc:
                from posttrain.engine.fsdp import PeerRefused

                return Rejected(None if isinstance(exc, PeerRefused) else exc)
        return self._run(method, args, checked=check)

    def _run(self, method: str, args: Sequence[object] | None, *, checked: bool) -> object:
        if self._sharded is not None:
            return self._sharded.call(method, args, checked=checked)
        if args is None:
            return None
        if checked:  # a forward_backward whose shard _agree checked
            return getattr(self.worker, method)(*args, checked=True)
        return getattr(self.worker, method)(*args)

    def _agree(self, shard: Sequence[object] | None) -> Rejected | None:
        error: BaseException | None = None
        if shard is not None:
            try:
                getattr(self.worker, "check_datums")(*shard)  # noqa: B009 - arity is Dispatch's
            except Exception as exc:
                error = exc
        if self.world_size > 1:
            flag = torch.tensor([float(error is not None)], device=self.worker.config.device)
            with collective("agreeing on the input"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if error is None and flag.item() > 0:
                return Rejected(None)
        return None if error is None else Rejected(error)

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Dispatch's placement moves of one `prepare`, in one call."""
        for group in offload:
            self.worker.offload(group)
        for group in reload:
            self.worker.reload(group)

    def ping(self) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def served_counts(self) -> dict[str, int]:
        return dict(self.served)

    def reduce_gradients(self) -> None:
        """all_reduce(SUM) of every replicated gradient; a rank without one contributes zeros.

        A parameter keeps grad None only if it has none on every rank, as in one process
        (AdamW leaves such a parameter and its moments untouched). Sharded (FSDP) gradients
        were already summed by their reduce-scatter.
        """
        params = [
            p for p in self.worker.trainable_parameters().values() if not isinstance(p, DTensor)
        ]
        if not params:
            return
        with collective("the gradient all-reduce"):
            _all_reduce_grads(params)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Sum the replicated gradients over the ranks, then step (one call for both)."""
        if self.world_size > 1:
            self.reduce_gradients()
        return self._run("optim_step", (adam,), checked=False)  # type: ignore[return-value]

    def full_tensors(self, kind: Literal["weights", "grads"]) -> dict[str, torch.Tensor | None]:
        """Trainable weights or gradients by name, whole on every rank (gathered if sharded)."""
        if self._sharded is not None:
            with collective(f"gathering {kind}"):
                return self._sharded.full_tensors(kind)
        params = self.worker.trainable_parameters()
        if kind == "weights":
            return {n: p.detach().cpu().clone() for n, p in params.items()}
        return {n: None if p.grad is None else p.grad.cpu().clone() for n, p in params.items()}

    def weight_digest(self) -> str:
        """SHA-256 of the whole trainable weights' bytes in name order (equal for equal weights,
        sharded or not)."""
        weights = self.full_tensors("weights")
        digest = hashlib.sha256()
        for name, tensor in weights.items():
            assert tensor is not None
            digest.update(name.encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def _all_reduce_grads(params: Sequence[torch.nn.Parameter]) -> None:
    device = params[0].device
    has_grad = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.float32, device=device
    )
    dist.all_reduce(has_grad)
    present = [p for p, flag in zip(params, has_grad.tolist(), strict=True) if flag > 0]
    for bucket in _buckets(present, BUCKET_NUMEL):
        # Summed in fp32 whatever the parameter dtype: exact for fp32, kinder to bf16.
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in bucket
            ]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in bucket:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()


def _buckets(
    params: Sequence[torch.nn.Parameter], max_numel: int
) -> list[list[torch.nn.Parameter]]:
    """Consecutive groups of parameters of at most `max_numel` elements (one if larger)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or size + p.numel() > max_numel:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def store_directory(rendezvous: str) -> Path | None:
    """The temporary directory of a file rendezvous (removed when the group closes)."""
    if not rendezvous.startswith("file://"):
        return None
    return Path(rendezvous.removeprefix("file://")).parent


def _node_address() -> str:
    """This node's address as Ray sees it (reachable by the other nodes of the cluster)."""
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except ImportError:
        return socket.gethostbyname(socket.gethostname())
