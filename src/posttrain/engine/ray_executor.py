"""RayExecutor: data-parallel workers as Ray actors joined in one torch.distributed group.

Each actor holds one `Worker` and runs what `Dispatch` asks of its rank. With
`sharding="replicate"` every rank holds a full replica and gradients are summed inside the
group with all_reduce(SUM), so with sum semantics the update equals the single-process update
on the whole mini-batch whatever the shard sizes, and every rank steps AdamW on identical
gradients (the replicas stay bit-identical). With `sharding="fsdp2"` the decoder is sharded
with FSDP2 (`engine.fsdp`), summed the same way.

Each primitive is one actor round trip, its arguments serialised once: a forward_backward
carries its own input check (each rank checks its shard, one all_reduce agrees), optim_step its
gradient all-reduce; the placement moves before a call, if any, are one more.

Failures never hang the caller, and never leave a group that silently diverged:
- a dead rank, a collective that failed or timed out (a stalled peer is bounded by
  `collective_timeout_s`), or an exception while changing state (forward_backward,
  optim_step, ...) fails the call at once with `WorkerGroupError` naming the rank and cause,
  and retires the group (close it and resume from the last checkpoint);
- an input every rank refused before changing anything (bad datums, a missing checkpoint),
  or an exception of a call that only reads (sampling a bad prompt), raises the worker's own
  error and the group carries on;
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
from typing import Literal, NoReturn

from posttrain.engine.placement import StateGroup
from posttrain.engine.ray_actor import (
    CollectiveError,
    Rejected,
    Sharding,
    WorkerHost,
    store_directory,
)
from posttrain.engine.ray_session import acquire_ray, import_ray, release_ray
from posttrain.engine.worker import Worker
from posttrain.types import AdamParams

CollectiveBackend = Literal["auto", "gloo", "nccl"]
# Calls that change no worker state: a worker's own exception in one of them leaves the group
# usable. Everything else (forward_backward, optim_step, load, offload, ...) may have changed
# some ranks and not others.
READ_ONLY = frozenset(
    {
        *("forward", "sample", "compute_logprobs", "reference_logprobs", "check_datums"),
        *("get_tokenizer", "grads", "trainable_parameters", "save_state", "save_weights"),
        *("ping", "pid", "node_id", "served_counts", "weight_digest", "full_tensors", "build"),
    }
)
# How long to wait for the other ranks' news after one reported a failed collective, so the
# error names the rank that died rather than the one that noticed.
_CULPRIT_WAIT_S = 1.0


class WorkerGroupError(RuntimeError):
    """A worker died, stalled or failed mid-update; the group cannot continue (resume from a
    checkpoint)."""


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
        self.config = config or RayConfig()
        self._ray = import_ray()
        self._broken: str | None = None
        self._closed = False
        self._actors: list[object] = []
        self._store_dirs: list[Path] = []
        self._num_workers = num_workers
        self._rank0_node: str | None = None  # rank 0's Ray node id, once asked
        self.rendezvous = ""  # where the ranks met: file://<temp dir>/store, or tcp://host:port
        self.round_trips = 0  # calls to the actors awaited so far (benchmarks count them)
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
            self._wait([a.build.remote() for a in self._actors], "build", deadline)  # type: ignore[attr-defined]
        except WorkerGroupError as exc:
            raise WorkerGroupError(
                f"{num_workers} workers needing {dict(cfg.resources_per_worker)} each did not "
                f"start within startup_timeout_s={cfg.startup_timeout_s}; the cluster has "
                f"{self._ray.available_resources()} available ({exc})"
            ) from exc
        auto = "nccl" if device.startswith("cuda") else "gloo"
        backend = auto if cfg.backend == "auto" else cfg.backend
        store = self._actors[0].create_store.remote()  # type: ignore[attr-defined]
        rendezvous = str(self._wait([store], "creating the rendezvous", deadline)[0])
        self.rendezvous = rendezvous
        if (directory := store_directory(rendezvous)) is not None:
            self._store_dirs.append(directory)
        joins = [
            a.join_group.remote(rendezvous, backend, cfg.collective_timeout_s)  # type: ignore[attr-defined]
            for a in self._actors
        ]
        self._wait(joins, "forming the process group", deadline)

    @property
    def num_workers(self) -> int:
        return self._num_workers

    def run(self, method: str, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        """Call `method` on each rank with its arguments; a rank given None is skipped (under
        FSDP it still takes part in the collectives of a method that gathers weights)."""
        return self._call(method, per_rank_args, check=False)

    def forward_backward(self, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        """One round trip: every rank checks its own shard, the ranks agree with one all_reduce
        and none computes unless all accepted (a refusal raises the worker's error and the
        group carries on), then each runs with its gradients committed. A fault after the
        agreement retires the group (module docstring), so nothing is left to undo."""
        return self._call("forward_backward", per_rank_args, check=True)

    def _call(
        self, method: str, per_rank_args: Sequence[tuple[object, ...] | None], *, check: bool
    ) -> list[object]:
        if len(per_rank_args) != self.num_workers:
            raise ValueError(
                f"per_rank_args has {len(per_rank_args)} entries; expected one per rank "
                f"({self.num_workers})"
            )
        # Every rank takes part in an agreement or a gathering method, with a shard or not.
        everyone = check or self._gathers(method)
        calls = {
            rank: actor.call.remote(method, per_rank_args[rank], check)  # type: ignore[attr-defined]
            for rank, actor in enumerate(self._actors)
            if per_rank_args[rank] is not None or everyone
        }
        values = self._gather(calls, method)
        return [values.get(rank) for rank in range(self.num_workers)]

    def move(self, offload: Sequence[StateGroup], reload: Sequence[StateGroup]) -> None:
        """Every rank parks, then reloads, in one round trip (a failure retires the group)."""
        self._all("move", list(offload), list(reload))

    def _gathers(self, method: str) -> bool:
        if self.config.sharding != "fsdp2":
            return False
        from posttrain.engine.fsdp import GATHERING_METHODS

        return method in GATHERING_METHODS

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Every rank sums its gradients with its peers' and steps, in one round trip."""
        return self._all("optim_step", adam)[0]  # type: ignore[return-value]

    def reduce_gradients(self) -> None:
        """Every rank's replicated gradients become the sum over ranks (sharded ones already are)."""
        if self.num_workers > 1:
            self._all("reduce_gradients")

    def weight_digests(self) -> list[str]:
        """A digest of each rank's whole trainable weights: all equal when replicas are in sync."""
        return self._all("weight_digest")  # type: ignore[return-value]

    def full_tensors(self, kind: Literal["weights", "grads"]) -> list[dict[str, object]]:
        """Each rank's whole trainable weights or gradients by name (gathered under FSDP)."""
        return self._all("full_tensors", kind)  # type: ignore[return-value]

    def served_counts(self) -> list[dict[str, int]]:
        """Datums or prompts each rank has handled, per method (how the work was shared)."""
        return self._all("served_counts")  # type: ignore[return-value]

    def pids(self) -> list[int]:
        """The operating-system process id of each rank's actor."""
        return self._all("pid")  # type: ignore[return-value]

    def ping(self) -> None:
        """One empty round trip to every rank (measures the per-call dispatch overhead)."""
        self._all("ping")

    def rank0_is_local(self) -> bool:
        """Whether rank 0's actor runs on this process's Ray node (sees the files it writes)."""
        if self._rank0_node is None:
            node = self._gather({0: self._actors[0].node_id.remote()}, "node_id")[0]  # type: ignore[attr-defined]
            self._rank0_node = str(node)
        return self._rank0_node == self._ray.get_runtime_context().get_node_id()

    def _all(self, host_method: str, *args: object) -> list[object]:
        calls = {
            rank: getattr(actor, host_method).remote(*args)
            for rank, actor in enumerate(self._actors)
        }
        values = self._gather(calls, host_method)
        return [values[rank] for rank in range(self.num_workers)]

    def _gather(self, calls: Mapping[int, object], what: str) -> dict[int, object]:
        """Results by rank, or the first failure at once (see the module docstring)."""
        self._check_usable()
        self.round_trips += 1
        deadline = time.monotonic() + self.config.call_timeout_s
        values = self._wait_by_rank(calls, what, deadline)
        refused = [v for v in values.values() if isinstance(v, Rejected)]
        if not refused:
            return values
        errors = [r.error for r in refused if r.error is not None]
        if len(refused) < len(values) or not errors:
            self._fail(f"{what} was refused on some ranks but ran on others")
        raise errors[0]  # refused on every rank before any change: the group carries on

    def _wait(self, refs: Sequence[object], what: str, deadline: float) -> list[object]:
        values = self._wait_by_rank(dict(enumerate(refs)), what, deadline)
        return [values[i] for i in range(len(refs))]

    def _wait_by_rank(
        self, calls: Mapping[int, object], what: str, deadline: float
    ) -> dict[int, object]:
        ray = self._ray
        pending = {ref: rank for rank, ref in calls.items()}
        values: dict[int, object] = {}
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(pending.values())
                self._fail(f"{what} did not finish on rank(s) {ranks} within the time limit")
            rank = pending.pop(ready[0])
            try:
                values[rank] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                if isinstance(cause, CollectiveError):
                    self._fail_collective(rank, cause, pending, what)
                if what in READ_ONLY:
                    raise cause from exc  # the worker's own error; nothing changed
                self._fail(
                    f"rank {rank} raised {type(cause).__name__} during {what} ({cause}); "
                    "the replicas may have diverged",
                    exc,
                )
            except ray.exceptions.RayError as exc:
                self._fail(f"rank {rank} died during {what}: {type(exc).__name__}: {exc}", exc)
        return values

    def _fail_collective(
        self, rank: int, cause: CollectiveError, pending: Mapping[object, int], what: str
    ) -> NoReturn:
        """Name the rank behind a failed collective: one that died, else those still running."""
        ray = self._ray
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_CULPRIT_WAIT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError:
                continue
            except ray.exceptions.RayError as exc:
                self._fail(f"rank {pending[ref]} died during {what}: {exc}", cause)
        silent = sorted(pending[ref] for ref in pending if ref not in ready)
        stalled = f"; rank(s) {silent} did not answer (stalled?)" if silent else ""
        self._fail(f"rank {rank} failed during {what}: {cause}{stalled}", cause)

    def _fail(self, reason: str, cause: BaseException | None = None) -> NoReturn:
        self._broken = reason
        raise WorkerGroupError(
            f"{reason}. The Ray worker group cannot continue: close() it and resume from the "
            "last checkpoint."
        ) from cause

    def _check_usable(self) -> None:
        if self._closed:
            raise WorkerGroupError("this RayExecutor is closed")
        if self._broken is not None:
            raise WorkerGroupError(
                f"the Ray worker group is unusable ({self._broken}); close() it and resume "
                "from the last checkpoint"
            )

    def close(self) -> None:
        """Kill the actors, remove the rendezvous files, release the Ray session (shut down if
        started here)."""
        self._closed = True
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
