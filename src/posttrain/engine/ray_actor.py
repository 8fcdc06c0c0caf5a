"""WorkerHost: what runs inside each Ray actor, one `Worker` and its place in the group.

Plain Python (no Ray import): `RayExecutor` wraps it with `ray.remote`, and it can be unit
tested in one process with a world of size 1.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.engine.ray_session import loopback_interface
from posttrain.engine.worker import Worker

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
        self._factory = factory
        self._worker: Worker | None = None
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
        """Join the process group, then take rank 0's trainable weights (replicas start equal)."""
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

    def call(self, method: str, args: Sequence[object]) -> object:
        return getattr(self.worker, method)(*args)

    def ping(self) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()

    def reduce_gradients(self) -> None:
        """all_reduce(SUM) of every gradient; a rank without one contributes zeros.

        A parameter keeps grad None only if it has none on every rank, as in one process
        (AdamW leaves such a parameter and its moments untouched).
        """
        params = list(self.worker.trainable_parameters().values())
        if not params:
            return
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

    def weight_digest(self) -> str:
        """SHA-256 of the trainable weights' bytes in name order."""
        digest = hashlib.sha256()
        for name, param in self.worker.trainable_parameters().items():
            digest.update(name.encode())
            data = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            digest.update(data.numpy().tobytes())
        return digest.hexdigest()


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


def _node_address() -> str:
    """This node's address as Ray sees it (reachable by the other nodes of the cluster)."""
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except ImportError:
        return socket.gethostbyname(socket.gethostname())
