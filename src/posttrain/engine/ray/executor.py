"""RayExecutor: data-parallel workers as Ray actors joined in one torch.distributed group.

Each actor holds one `Worker` and runs what `Dispatch` asks of its rank. With
`sharding="replicate"` every rank holds a full replica and gradients are summed inside the
group with all_reduce(SUM), so with sum semantics the update equals the single-process update
on the whole mini-batch whatever the shard sizes, and every rank steps AdamW on identical
gradients (the replicas stay bit-identical). With `sharding="fsdp2"` the decoder is sharded
with FSDP2 (`engine.fsdp`), summed the same way.

Each primitive is one actor round trip to a typed `WorkerHost` method, its arguments serialised
once: a forward_backward carries its own input check (each rank checks its shard, one all_reduce
agrees), optim_step its gradient all-reduce; the placement moves before a call, if any, are one
more. Which ranks a call needs, and whether a worker's exception in it retires the group, are
declared on the host method (`engine.rank_calls`).

Failures never hang the caller, and never leave a group that silently diverged:
- a dead rank, a collective that failed or timed out (a stalled peer is bounded by
  `collective_timeout_s`), or an exception while changing state (forward_backward,
  optim_step, ...) fails the call at once with `WorkerGroupError` naming the rank and cause,
  and retires the group (close it and resume from the last checkpoint);
- an input every rank refused before changing anything (bad datums, a missing checkpoint),
  or an exception of a call that only reads (`read_only`: sampling a bad prompt), raises the
  worker's own error and the group carries on;
- every call is bounded by `call_timeout_s`.
"""

from __future__ import annotations

import shutil
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from posttrain.engine.executor import (
    LoadRequest,
    PassShard,
    PromptShard,
    SaveRequest,
    TensorKind,
)
from posttrain.engine.placement import StateGroup
from posttrain.engine.ray.actor import Sharding, WorkerHost, store_directory
from posttrain.engine.ray.calls import ActorCalls, WorkerGroupError, remote
from posttrain.engine.ray.session import acquire_ray, import_ray, release_ray
from posttrain.engine.ray.shared_storage import StorageNotShared, not_shared_message, write_marker
from posttrain.engine.worker import PassResult, Worker
from posttrain.tokenizer import Tokenizer
from posttrain.types import AdamParams, Datum, SampleResponse

CollectiveBackend = Literal["auto", "gloo", "nccl"]


@dataclass(frozen=True)
class RayConfig:
    """Where and how the worker actors run."""

    address: str | None = None  # None: start a local Ray on 127.0.0.1; else join this cluster
    # Ray resources per worker ("CPU", "GPU", or custom names).
    resources_per_worker: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    num_threads_per_worker: int | None = None  # torch threads; None: the worker's CPUs (>= 1)
    backend: CollectiveBackend = "auto"  # auto: nccl for cuda devices, else gloo
    sharding: Sharding = "replicate"  # "fsdp2": shard the decoder with FSDP2 (engine.fsdp)
    collective_timeout_s: float = 300.0  # bounds a collective waiting on a stalled peer
    startup_timeout_s: float = 300.0  # actors placed, models loaded, group formed
    call_timeout_s: float = 3600.0  # bounds every call, collective or not

    def __post_init__(self) -> None:
        for key, amount in self.resources_per_worker.items():
            if not amount >= 0:
                raise ValueError(f"resources_per_worker[{key!r}] must be >= 0, got {amount}")
        if self.num_threads_per_worker is not None and self.num_threads_per_worker < 1:
            raise ValueError(
                f"num_threads_per_worker must be >= 1 or None, got {self.num_threads_per_worker}"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if self.sharding not in ("replicate", "fsdp2"):
            raise ValueError(f"sharding must be 'replicate' or 'fsdp2', got {self.sharding!r}")
        for key in ("collective_timeout_s", "startup_timeout_s", "call_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0 seconds, got {getattr(self, key)}")

    @property
    def num_cpus(self) -> float:
        return float(self.resources_per_worker.get("CPU", 0.0))

    @property
    def num_gpus(self) -> float:
        return float(self.resources_per_worker.get("GPU", 0.0))

    def threads(self) -> int:
        return self.num_threads_per_worker or max(1, int(self.num_cpus))


class RayExecutor:
    """The `Executor` protocol over Ray actors; `close()` (or interpreter exit) frees them."""

    def __init__(
        self,
        worker_factory: Callable[[], Worker],
        num_workers: int,
        config: RayConfig | None = None,
        *,
        device: str = "cpu",
        cpu_factory: Callable[[], Worker] | None = None,
    ) -> None:
        """`cpu_factory` builds the same replica on the CPU: under FSDP2, rank 0's replica for
        checkpoint I/O (None: `worker_factory`'s, moved to the CPU once built)."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        config = config or RayConfig()
        self._ray = import_ray()
        self._actors: list[object] = []
        self._calls = ActorCalls(
            self._ray,
            self._actors,
            sharded=config.sharding == "fsdp2",
            timeout_s=config.call_timeout_s,
        )
        self.config = config
        self._store_dirs: list[Path] = []
        self._num_workers = num_workers
        self.rendezvous = ""  # where the ranks met: file://<temp dir>/store, or tcp://host:port
        loopback = acquire_ray(self.config.address, num_workers * self.config.num_cpus)
        # Frees the actors on close(), on garbage collection, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _free, self._ray, self._actors, self._store_dirs)
        try:
            self._start(worker_factory, cpu_factory, num_workers, device, loopback)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        factory: Callable[[], Worker],
        cpu_factory: Callable[[], Worker] | None,
        num_workers: int,
        device: str,
        loopback: bool,
    ) -> None:
        cfg = self.config
        custom = {k: v for k, v in cfg.resources_per_worker.items() if k not in ("CPU", "GPU")}
        actor_cls = self._ray.remote(WorkerHost)
        self._actors.extend(
            actor_cls.options(
                num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, resources=custom, max_restarts=0
            ).remote(rank, num_workers, factory, cfg.threads(), loopback, cfg.sharding, cpu_factory)
            for rank in range(num_workers)
        )
        deadline = time.monotonic() + cfg.startup_timeout_s
        try:
            builds = [remote(a, WorkerHost.build) for a in self._actors]
            self._calls.wait(builds, WorkerHost.build, "build", deadline)
        except WorkerGroupError as exc:
            raise WorkerGroupError(
                f"{num_workers} workers needing {dict(cfg.resources_per_worker)} each did not "
                f"start within startup_timeout_s={cfg.startup_timeout_s}; the cluster has "
                f"{self._ray.available_resources()} available ({exc})"
            ) from exc
        auto = "nccl" if device.startswith("cuda") else "gloo"
        backend = auto if cfg.backend == "auto" else cfg.backend
        store = remote(self._actors[0], WorkerHost.create_store)
        rendezvous = self._calls.wait(
            [store], WorkerHost.create_store, "creating the rendezvous", deadline
        )[0]
        self.rendezvous = rendezvous
        if (directory := store_directory(rendezvous)) is not None:
            self._store_dirs.append(directory)
        joins = [
            remote(a, WorkerHost.join_group, rendezvous, backend, cfg.collective_timeout_s)
            for a in self._actors
        ]
        self._calls.wait(joins, WorkerHost.join_group, "forming the process group", deadline)

    @property
    def config(self) -> RayConfig:
        return self._config

    @config.setter
    def config(self, config: RayConfig) -> None:
        """New settings bound the calls from the next one on (the actors stay as they are)."""
        self._config = config
        self._calls.timeout_s = config.call_timeout_s

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def round_trips(self) -> int:
        """Calls to the actors awaited so far (benchmarks count them)."""
        return self._calls.round_trips

    def forward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        return self._calls.listed(self._calls.per_rank(WorkerHost.forward, shards))

    def forward_backward(self, shards: Sequence[PassShard | None]) -> list[PassResult | None]:
        """One round trip: every rank checks its own shard, the ranks agree with one all_reduce
        and none computes unless all accepted (a refusal raises the worker's error and the
        group carries on), then each runs with its gradients committed. A fault after the
        agreement retires the group (module docstring), so nothing is left to undo."""
        return self._calls.listed(self._calls.accepted(WorkerHost.forward_backward, shards))

    def sample(self, shards: Sequence[PromptShard | None]) -> list[list[SampleResponse] | None]:
        return self._calls.listed(self._calls.per_rank(WorkerHost.sample, shards))

    def compute_logprobs(
        self, prompts: Sequence[Sequence[int] | None]
    ) -> list[list[float | None] | None]:
        return self._calls.listed(self._calls.per_rank(WorkerHost.compute_logprobs, prompts))

    def reference_logprobs(
        self, shards: Sequence[Sequence[Datum] | None]
    ) -> list[list[torch.Tensor] | None]:
        return self._calls.listed(self._calls.per_rank(WorkerHost.reference_logprobs, shards))

    def save_state(self, requests: Sequence[SaveRequest | None]) -> list[Path | None]:
        return self._calls.listed(self._calls.per_rank(WorkerHost.save_state, requests))

    def save_weights(self, paths: Sequence[Path | None]) -> list[Path | None]:
        return self._calls.listed(self._calls.per_rank(WorkerHost.save_weights, paths))

    def load_state(self, requests: Sequence[LoadRequest | None]) -> None:
        self._calls.accepted(WorkerHost.load_state, requests)

    def set_logprob_chunk_size(self, sizes: Sequence[int | None]) -> None:
        self._calls.per_rank(WorkerHost.set_logprob_chunk_size, sizes)

    def set_packing(self, values: Sequence[bool | None]) -> None:
        self._calls.per_rank(WorkerHost.set_packing, values)

    def get_tokenizer(self) -> Tokenizer | None:
        return self._calls.on_rank(0, WorkerHost.get_tokenizer)

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Every rank parks, then reloads, in one round trip (a failure retires the group)."""
        self._calls.all(WorkerHost.move, list(offload), list(reload))

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Every rank sums its gradients with its peers' and steps, in one round trip."""
        return self._calls.all(WorkerHost.optim_step, adam)[0]

    def reduce_gradients(self) -> None:
        """Every rank's replicated gradients become the sum over ranks (sharded ones already are)."""
        if self.num_workers > 1:
            self._calls.all(WorkerHost.reduce_gradients)

    def weight_digests(self) -> list[str]:
        """A digest of each rank's whole trainable weights: all equal when replicas are in sync."""
        return self._calls.all(WorkerHost.weight_digest)

    def full_tensors(self, kind: TensorKind) -> list[dict[str, torch.Tensor | None]]:
        """Each rank's whole trainable weights or gradients by name (gathered under FSDP)."""
        return self._calls.all(WorkerHost.full_tensors, kind)

    def served_counts(self) -> list[dict[str, int]]:
        """Datums or prompts each rank has handled, per method (how the work was shared)."""
        return self._calls.all(WorkerHost.served_counts)

    def pids(self) -> list[int]:
        """The operating-system process id of each rank's actor."""
        return self._calls.all(WorkerHost.pid)

    def ping(self) -> None:
        """One empty round trip to every rank (measures the per-call dispatch overhead)."""
        self._calls.all(WorkerHost.ping)

    def node_ids(self) -> list[str]:
        """The Ray node each rank's actor runs on."""
        return self._calls.all(WorkerHost.node_id)

    def check_storage(self, directory: Path) -> None:
        """Refuse `directory` (StorageNotShared) unless every rank that reads or writes
        checkpoint files there sees it as this process does: rank 0 under FSDP2 (it alone
        does the I/O), else every rank (each replica loads the checkpoint itself)."""
        ranks = [0] if self.config.sharding == "fsdp2" else range(self.num_workers)
        marker, token = write_marker(directory)
        try:
            seen = self._calls.all(WorkerHost.read_marker, str(marker))
        finally:
            marker.unlink(missing_ok=True)
        blind = [rank for rank in ranks if seen[rank] != token]
        if blind:
            nodes = self.node_ids()
            raise StorageNotShared(not_shared_message(directory, [(r, nodes[r]) for r in blind]))

    def close(self) -> None:
        """Kill the actors, remove the rendezvous files, release the Ray session (shut down if
        started here)."""
        self._calls.closed = True
        self._finalizer()


def _free(ray: ModuleType, actors: list[object], store_dirs: list[Path]) -> None:
    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor, no_restart=True)
    actors.clear()
    for directory in store_dirs:
        shutil.rmtree(directory, ignore_errors=True)
    store_dirs.clear()
    release_ray()
