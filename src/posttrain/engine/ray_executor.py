"""RayExecutor: data-parallel workers as Ray actors joined in one torch.distributed group.

Each actor holds one `Worker` (a full replica) and runs what `Dispatch` asks of its rank.
Gradients are summed inside the group with all_reduce(SUM) instead of travelling through the
driver, so with sum semantics the update equals the single-process update on the whole
mini-batch, whatever the shard sizes (a rank without datums joins with zeros). Every rank
then steps AdamW on identical gradients, which keeps the replicas bit-identical.

Failures never hang the caller: a dead actor fails the call at once (and the group with it),
a stalled peer is bounded by the process group's timeout (`collective_timeout_s`, not
torch's 30-minute default), and `call_timeout_s` can bound every call.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal, NoReturn

from posttrain.engine.ray_actor import WorkerHost
from posttrain.engine.ray_session import acquire_ray, import_ray, release_ray
from posttrain.engine.worker import Worker

CollectiveBackend = Literal["auto", "gloo", "nccl"]


class WorkerGroupError(RuntimeError):
    """A worker died or timed out; the group cannot continue (resume from a checkpoint)."""


@dataclass(frozen=True)
class RayConfig:
    """Where and how the worker actors run."""

    address: str | None = None  # None: start a local Ray on 127.0.0.1; else join this cluster
    # Ray resources per worker ("CPU", "GPU", or custom names).
    resources_per_worker: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    num_threads_per_worker: int | None = None  # torch threads; None: the worker's CPUs (>= 1)
    backend: CollectiveBackend = "auto"  # auto: nccl for cuda devices, else gloo
    collective_timeout_s: float = 300.0  # bounds a collective waiting on a stalled peer
    startup_timeout_s: float = 300.0  # actors placed, models loaded, group formed
    call_timeout_s: float | None = None  # None: only collectives are bounded

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
        for key in ("collective_timeout_s", "startup_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be > 0 seconds, got {getattr(self, key)}")
        if self.call_timeout_s is not None and not self.call_timeout_s > 0:
            raise ValueError(
                f"call_timeout_s must be > 0 seconds or None, got {self.call_timeout_s}"
            )

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
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.config = config or RayConfig()
        self._ray = import_ray()
        self._broken: str | None = None
        self._closed = False
        self._actors: list[object] = []
        self._num_workers = num_workers
        loopback = acquire_ray(self.config.address, num_workers * self.config.num_cpus)
        # Frees the actors on close(), on garbage collection, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _free, self._ray, self._actors)
        try:
            self._start(worker_factory, num_workers, device, loopback)
        except BaseException:
            self.close()
            raise

    def _start(
        self, factory: Callable[[], Worker], num_workers: int, device: str, loopback: bool
    ) -> None:
        cfg = self.config
        custom = {k: v for k, v in cfg.resources_per_worker.items() if k not in ("CPU", "GPU")}
        actor_cls = self._ray.remote(WorkerHost)
        self._actors.extend(
            actor_cls.options(
                num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, resources=custom, max_restarts=0
            ).remote(rank, num_workers, factory, cfg.threads(), loopback)
            for rank in range(num_workers)
        )
        deadline = time.monotonic() + cfg.startup_timeout_s
        try:
            self._wait_all([a.build.remote() for a in self._actors], "startup", deadline)  # type: ignore[attr-defined]
        except WorkerGroupError as exc:
            raise WorkerGroupError(
                f"{num_workers} workers needing {dict(cfg.resources_per_worker)} each did not "
                f"start within startup_timeout_s={cfg.startup_timeout_s}; the cluster has "
                f"{self._ray.available_resources()} available ({exc})"
            ) from exc
        auto = "nccl" if device.startswith("cuda") else "gloo"
        backend = auto if cfg.backend == "auto" else cfg.backend
        store = self._actors[0].create_store.remote()  # type: ignore[attr-defined]
        rendezvous = self._wait_all([store], "creating the rendezvous", deadline)[0]
        joins = [
            a.join_group.remote(rendezvous, backend, cfg.collective_timeout_s)  # type: ignore[attr-defined]
            for a in self._actors
        ]
        self._wait_all(joins, "forming the process group", deadline)

    @property
    def num_workers(self) -> int:
        return self._num_workers

    def run(self, method: str, per_rank_args: Sequence[tuple[object, ...] | None]) -> list[object]:
        """Call `method` on each rank with its arguments; a rank given None is skipped."""
        if len(per_rank_args) != self.num_workers:
            raise ValueError(
                f"per_rank_args has {len(per_rank_args)} entries; expected one per rank "
                f"({self.num_workers})"
            )
        calls = {
            rank: self._actors[rank].call.remote(method, args)  # type: ignore[attr-defined]
            for rank, args in enumerate(per_rank_args)
            if args is not None
        }
        values = self._gather(calls, method)
        return [values.get(rank) for rank in range(self.num_workers)]

    def reduce_gradients(self) -> None:
        """Every rank's gradients become the sum over ranks (all_reduce inside the group)."""
        if self.num_workers > 1:
            self._all("reduce_gradients")

    def weight_digests(self) -> list[str]:
        """A digest of each rank's trainable weights: all equal when replicas are in sync."""
        return self._all("weight_digest")  # type: ignore[return-value]

    def pids(self) -> list[int]:
        """The operating-system process id of each rank's actor."""
        return self._all("pid")  # type: ignore[return-value]

    def ping(self) -> None:
        """One empty round trip to every rank (measures the per-call dispatch overhead)."""
        self._all("ping")

    def _all(self, host_method: str) -> list[object]:
        calls = {
            rank: getattr(actor, host_method).remote() for rank, actor in enumerate(self._actors)
        }
        values = self._gather(calls, host_method)
        return [values[rank] for rank in range(self.num_workers)]

    def _gather(self, calls: Mapping[int, object], what: str) -> dict[int, object]:
        """Results by rank. A dead or timed-out rank raises at once; a worker's own exception
        (bad input, say) is re-raised after the other ranks have finished."""
        self._check_usable()
        timeout = self.config.call_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._wait_all_by_rank(calls, what, deadline)

    def _wait_all(self, refs: Sequence[object], what: str, deadline: float | None) -> list[object]:
        values = self._wait_all_by_rank(dict(enumerate(refs)), what, deadline)
        return [values[i] for i in range(len(refs))]

    def _wait_all_by_rank(
        self, calls: Mapping[int, object], what: str, deadline: float | None
    ) -> dict[int, object]:
        ray = self._ray
        pending = {ref: rank for rank, ref in calls.items()}
        values: dict[int, object] = {}
        worker_error: BaseException | None = None
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(pending.values())
                self._fail(f"{what} did not finish on rank(s) {ranks} within the time limit")
            ref = ready[0]
            rank = pending.pop(ref)
            try:
                values[rank] = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                # The worker raised: its exception type survives (Ray subclasses it).
                worker_error = worker_error or exc
                if what == "reduce_gradients":
                    self._broken = f"rank {rank} failed in the gradient all-reduce: {exc}"
            except ray.exceptions.RayError as exc:
                self._fail(f"rank {rank} died during {what}: {type(exc).__name__}: {exc}", exc)
        if worker_error is not None:
            raise worker_error
        return values

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
        """Kill the actors and release the Ray session (shut down if started here)."""
        self._closed = True
        self._finalizer()


def _free(ray: ModuleType, actors: list[object]) -> None:
    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor, no_restart=True)
    actors.clear()
    release_ray()
