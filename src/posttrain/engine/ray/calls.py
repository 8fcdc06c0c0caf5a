"""Calls on the Ray actors of a worker group, by rank, and what a failure does to the group.

Each call goes to typed `WorkerHost` methods; which ranks it needs, and whether a worker's own
exception in it leaves the group usable, come from the method (`engine.rank_calls`). The
failure rules are `engine.ray_executor`'s: a dead rank, a failed collective or an exception
while changing state retires the group; a refusal on every rank, or an exception in a read-only
call, raises the worker's own error; every call is bounded in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Concatenate, NoReturn, ParamSpec, TypeVar

from posttrain.engine.ray.actor import WorkerHost
from posttrain.engine.ray.rank_calls import CollectiveError, Rejected, kind_of

A = TypeVar("A")
R = TypeVar("R")
P = ParamSpec("P")
# How long to wait for the other ranks' news after one reported a failed collective, so the
# error names the rank that died rather than the one that noticed.
_CULPRIT_WAIT_S = 1.0


class WorkerGroupError(RuntimeError):
    """A worker died, stalled or failed mid-update; the group cannot continue (resume from a
    checkpoint)."""


class ActorCalls:
    """Calls on `actors` (one `WorkerHost` per rank, in rank order), each bounded by
    `timeout_s` seconds; `sharded`: the model is sharded with FSDP2."""

    def __init__(
        self,
        ray: ModuleType,
        actors: Sequence[object],
        *,
        sharded: bool,
        timeout_s: float,
    ) -> None:
        self._ray = ray
        self.actors = actors
        self.sharded = sharded
        self.timeout_s = timeout_s
        self.round_trips = 0  # calls awaited so far (benchmarks count them)
        self.broken: str | None = None  # why the group was retired
        self.closed = False

    def per_rank(
        self, method: Callable[[WorkerHost, A | None], R], inputs: Sequence[A | None]
    ) -> dict[int, R]:
        """`method` on each rank with its input; a rank given None is not called unless the
        method needs every rank (`CallKind.everyone`), which then takes part with None."""
        if len(inputs) != len(self.actors):
            raise ValueError(
                f"{len(inputs)} inputs for {len(self.actors)} ranks; give one per rank"
            )
        everyone = kind_of(method).everyone(sharded=self.sharded)
        calls = {
            rank: remote(actor, method, inputs[rank])
            for rank, actor in enumerate(self.actors)
            if inputs[rank] is not None or everyone
        }
        return self._gather(calls, method)

    def all(
        self, method: Callable[Concatenate[WorkerHost, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """SkyRL's pass-through: the same call on every rank; results in rank order."""
        calls = {
            rank: remote(actor, method, *args, **kwargs) for rank, actor in enumerate(self.actors)
        }
        values = self._gather(calls, method)
        return [values[rank] for rank in range(len(self.actors))]

    def on_rank(
        self,
        rank: int,
        method: Callable[Concatenate[WorkerHost, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        ref = remote(self.actors[rank], method, *args, **kwargs)
        return self._gather({rank: ref}, method)[rank]

    def listed(self, values: Mapping[int, R]) -> list[R | None]:
        """Results in rank order, None for a rank that was not called."""
        return [values.get(rank) for rank in range(len(self.actors))]

    def accepted(
        self, method: Callable[[WorkerHost, A | None], R | Rejected], inputs: Sequence[A | None]
    ) -> dict[int, R]:
        """`per_rank` for a call a rank may refuse (`Rejected`) before changing anything: the
        results, else the refusal's error when every rank refused (the group carries on), else
        the group is retired."""
        values = self.per_rank(method, inputs)
        accepted = {rank: v for rank, v in values.items() if not isinstance(v, Rejected)}
        if len(accepted) == len(values):
            return accepted
        errors = [
            v.error for v in values.values() if isinstance(v, Rejected) and v.error is not None
        ]
        if accepted or not errors:
            self.fail(f"{method.__name__} was refused on some ranks but ran on others")
        raise errors[0]  # refused on every rank before any change: the group carries on

    def _gather(self, calls: Mapping[int, object], method: Callable[..., R]) -> dict[int, R]:
        """Results by rank, or the first failure at once (see the module docstring)."""
        self._check_usable()
        self.round_trips += 1
        deadline = time.monotonic() + self.timeout_s
        return self._wait_by_rank(calls, method, method.__name__, deadline)

    def wait(
        self, refs: Sequence[object], method: Callable[..., R], what: str, deadline: float
    ) -> list[R]:
        """The results of start-up calls of `method`, in order."""
        values = self._wait_by_rank(dict(enumerate(refs)), method, what, deadline)
        return [values[i] for i in range(len(refs))]

    def _wait_by_rank(
        self, calls: Mapping[int, object], method: Callable[..., R], what: str, deadline: float
    ) -> dict[int, R]:
        ray = self._ray
        read_only = kind_of(method).read_only
        pending = {ref: rank for rank, ref in calls.items()}
        values: dict[int, R] = {}
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(pending.values())
                self.fail(f"{what} did not finish on rank(s) {ranks} within the time limit")
            rank = pending.pop(ready[0])
            try:
                values[rank] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                if isinstance(cause, CollectiveError):
                    self._fail_collective(rank, cause, pending, what)
                if read_only:
                    raise cause from exc  # the worker's own error; nothing changed
                self.fail(
                    f"rank {rank} raised {type(cause).__name__} during {what} ({cause}); "
                    "the replicas may have diverged",
                    exc,
                )
            except ray.exceptions.RayError as exc:
                self.fail(f"rank {rank} died during {what}: {type(exc).__name__}: {exc}", exc)
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
                self.fail(f"rank {pending[ref]} died during {what}: {exc}", cause)
        silent = sorted(pending[ref] for ref in pending if ref not in ready)
        stalled = f"; rank(s) {silent} did not answer (stalled?)" if silent else ""
        self.fail(f"rank {rank} failed during {what}: {cause}{stalled}", cause)

    def fail(self, reason: str, cause: BaseException | None = None) -> NoReturn:
        self.broken = reason
        raise WorkerGroupError(
            f"{reason}. The Ray worker group cannot continue: close() it and resume from the "
            "last checkpoint."
        ) from cause

    def _check_usable(self) -> None:
        if self.closed:
            raise WorkerGroupError("this RayExecutor is closed")
        if self.broken is not None:
            raise WorkerGroupError(
                f"the Ray worker group is unusable ({self.broken}); close() it and resume "
                "from the last checkpoint"
            )


def remote(
    actor: object,
    method: Callable[Concatenate[WorkerHost, P], object],
    *args: P.args,
    **kwargs: P.kwargs,
) -> object:
    """Start `method` on a `WorkerHost` actor; returns the reference to its result."""
    return getattr(actor, method.__name__).remote(*args, **kwargs)
