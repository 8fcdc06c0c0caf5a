"""WorkerHost: what runs inside each Ray actor, one `Worker` and its place in the group.

Plain Python (no Ray import): `RayExecutor` wraps it with `ray.remote`, and it can be unit
tested in one process with a world of size 1. Each method the executor calls is typed and
declares how it is called (`engine.rank_calls.rank_call`): whether a worker's own exception
leaves the group usable, and whether every rank must take part.

Failures are reported so the executor can tell them apart: a collective that failed or timed
out raises `CollectiveError` (the group's collectives are out of step: it cannot continue); an
input every rank refused before changing anything comes back as a `Rejected` value (the group
stays usable); anything else is the worker's own exception.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.engine.executor import (
    LoadRequest,
    PassShard,
    PromptShard,
    SaveRequest,
    TensorKind,
    weight_digest,
    worker_tensors,
)
from posttrain.engine.placement import StateGroup
from posttrain.engine.ray.rank_calls import (
    CollectiveError,
    PeerRefused,
    Rejected,
    collective,
    rank_call,
)
from posttrain.engine.ray.session import loopback_interface
from posttrain.engine.ray.shared_storage import read_marker
from posttrain.engine.worker import PassResult, Worker
from posttrain.tokenizer import Tokenizer
from posttrain.types import AdamParams, Datum, SampleResponse

if TYPE_CHECKING:
    from posttrain.engine.ray.fsdp import ShardedWorker

A = TypeVar("A")
R = TypeVar("R")
Sharding = Literal["replicate", "fsdp2"]
BUCKET_NUMEL = 1 << 24  # 64 MiB of fp32 per all_reduce: few calls, bounded extra memory


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

    @rank_call(read_only=True)  # a loading error keeps its type, as in one process
    def build(self) -> None:
        """Load the model (a separate call so a loading error keeps its exception type)."""
        self._worker = self._factory()

    @rank_call(read_only=False)
    def create_store(self) -> str:
        """Rank 0: where the ranks meet. A file when all ranks share this machine's loopback
        (no socket at all), else a TCP store on a free port of this node."""
        if self.loopback:
            return "file://" + str(Path(tempfile.mkdtemp(prefix="posttrain-group-")) / "store")
        self._store = dist.TCPStore(
            self.host, 0, self.world_size, is_master=True, wait_for_workers=False
        )
        return f"tcp://{self.host}:{self._store.port}"

    @rank_call(read_only=False)
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
            from posttrain.engine.ray.fsdp import ShardedWorker

            self._sharded = ShardedWorker(self.worker, self._cpu_factory or self._factory)

    @rank_call(read_only=True, collective="sharded")
    def forward(self, shard: PassShard | None) -> PassResult | None:
        self._count("forward", None if shard is None else shard.datums)
        return self._reading(shard, lambda s: self.worker.forward(s.datums, s.loss_fn, s.config))

    @rank_call(read_only=False, collective="always")
    def forward_backward(self, shard: PassShard | None) -> PassResult | Rejected | None:
        """Every rank checks its own shard and the ranks agree with one all_reduce, so either
        all compute or none does (a refusal comes back as `Rejected`); the pass then runs
        without checking again."""
        self._count("forward_backward", None if shard is None else shard.datums)
        refused = self._agree(shard)
        if refused is not None:
            return refused
        if self._sharded is not None:
            return self._sharded.forward_backward(shard)
        if shard is None:
            return None
        return self.worker.forward_backward(shard.datums, shard.loss_fn, shard.config, checked=True)

    def _agree(self, shard: PassShard | None) -> Rejected | None:
        error: BaseException | None = None
        if shard is not None:
            try:
                self.worker.check_datums(shard.datums, shard.loss_fn, shard.config)
            except Exception as exc:
                error = exc
        if self.world_size > 1:
            flag = torch.tensor([float(error is not None)], device=self.worker.config.device)
            with collective("agreeing on the input"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if error is None and flag.item() > 0:
                return Rejected(None)
        return None if error is None else Rejected(error)

    @rank_call(read_only=True, collective="sharded")
    def sample(self, shard: PromptShard | None) -> list[SampleResponse] | None:
        self._count("sample", None if shard is None else shard.prompts)
        return self._reading(
            shard, lambda s: self.worker.sample(s.prompts, s.num_samples, s.params, s.first_index)
        )

    @rank_call(read_only=True, collective="sharded")
    def compute_logprobs(self, prompt: Sequence[int] | None) -> list[float | None] | None:
        return self._reading(prompt, self.worker.compute_logprobs)

    @rank_call(read_only=True, collective="sharded")
    def reference_logprobs(self, datums: Sequence[Datum] | None) -> list[torch.Tensor] | None:
        self._count("reference_logprobs", datums)
        return self._reading(datums, self.worker.reference_logprobs)

    def _reading(self, work: A | None, run: Callable[[A], R]) -> R | None:
        """`run(work)`, which only reads the weights. Under FSDP every rank first gathers them;
        a rank with no work of its own (None) only helps."""
        gathered = self._sharded.gathered() if self._sharded is not None else nullcontext()
        with gathered:
            return None if work is None else run(work)

    def _count(self, method: str, items: Sequence[object] | None) -> None:
        if items is not None:
            self.served[method] += len(items)

    @rank_call(read_only=True, collective="sharded")
    def save_state(self, request: SaveRequest | None) -> Path | None:
        """The rank given the request writes (rank 0: replicas are equal); under FSDP the
        others send it their pieces."""
        if self._sharded is not None:
            return self._sharded.checkpoints.save_state(request)
        if request is None:
            return None
        return self.worker.save_state(request.path, request.with_optimizer, request.trainer_state)

    @rank_call(read_only=True, collective="sharded")
    def save_weights(self, path: Path | None) -> Path | None:
        if self._sharded is not None:
            return self._sharded.checkpoints.save_weights(path)
        return None if path is None else self.worker.save_weights(path)

    @rank_call(read_only=False, collective="sharded")
    def load_state(self, request: LoadRequest | None) -> Rejected | None:
        """Every replica loads; under FSDP rank 0 alone reads and the others take its tensors
        (the checkpoint need not be on a filesystem they see). A checkpoint refused before any
        weight changes comes back as `Rejected`: the group carries on."""
        try:
            if self._sharded is not None:
                self._sharded.checkpoints.load_state(request if self.rank == 0 else None)
            elif request is not None:
                self.worker.load_state(request.path, with_optimizer=request.with_optimizer)
        except CollectiveError:
            raise
        except Exception as exc:
            return Rejected(None if isinstance(exc, PeerRefused) else exc)
        return None

    @rank_call(read_only=False)
    def set_logprob_chunk_size(self, size: int | None) -> None:
        if size is not None:
            self.worker.set_logprob_chunk_size(size)

    @rank_call(read_only=False)
    def set_packing(self, packing: bool | None) -> None:
        if packing is not None:
            self.worker.set_packing(packing)

    @rank_call(read_only=True)
    def get_tokenizer(self) -> Tokenizer | None:
        return self.worker.get_tokenizer()

    @rank_call(read_only=False)
    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Dispatch's placement moves of one `prepare`, in one call."""
        self.worker.move(offload, reload)

    @rank_call(read_only=True)
    def ping(self) -> None:
        return None

    @rank_call(read_only=True)
    def pid(self) -> int:
        return os.getpid()

    @rank_call(read_only=True)
    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    @rank_call(read_only=True)
    def read_marker(self, path: str) -> str | None:
        """The driver's storage marker as this rank sees it (`engine.shared_storage`)."""
        return read_marker(path)

    @rank_call(read_only=True)
    def served_counts(self) -> dict[str, int]:
        return dict(self.served)

    @rank_call(read_only=False)
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

    @rank_call(read_only=False)
    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Sum the replicated gradients over the ranks, then step (one call for both)."""
        if self.world_size > 1:
            self.reduce_gradients()
        if self._sharded is not None:
            return self._sharded.optim_step(adam)
        return self.worker.optim_step(adam)

    @rank_call(read_only=True)
    def full_tensors(self, kind: TensorKind) -> dict[str, torch.Tensor | None]:
        """Trainable weights or gradients by name, whole on every rank (gathered if sharded)."""
        if self._sharded is not None:
            with collective(f"gathering {kind}"):
                return self._sharded.full_tensors(kind)
        return worker_tensors(self.worker, kind)

    @rank_call(read_only=True)
    def weight_digest(self) -> str:
        """SHA-256 of the whole trainable weights (equal for equal weights, sharded or not)."""
        return weight_digest(self.full_tensors("weights"))


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
